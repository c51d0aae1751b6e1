"""``anyspeed fsdp2`` checkpoints: saved at 2 ranks, resumed at 1 rank (the same global batch
by accumulation), the run goes on as the uninterrupted one; the exported directory loads in
transformers with the trained model's logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anyspeed.testing import run_distributed
from helpers import fsdp_ranks as R


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    from helpers.corpora import write_corpus

    return write_corpus(str(tmp_path_factory.mktemp("fsdp_resume") / "corpus"), docs=60)


def test_saved_at_two_ranks_resumes_at_one(tmp_path, corpus: str) -> None:
    model_dir = R.text_model(tmp_path / "m", "qwen2")
    probe = torch.arange(3, 40).reshape(1, -1)
    whole = R.write_config(
        tmp_path / "whole.yaml", model_dir, corpus, data={"shuffle": True},
        training={"max_steps": 4, "output_dir": str(tmp_path / "whole"), "save_hf_weights": True},
    )  # fmt: skip
    ref = run_distributed(R.train_rank, 2, config=whole, probe=probe, timeout=240)[0]
    out = str(tmp_path / "split")
    first = R.write_config(
        tmp_path / "a.yaml", model_dir, corpus, data={"shuffle": True},
        training={"max_steps": 2, "output_dir": out},
    )  # fmt: skip
    run_distributed(R.train_rank, 2, config=first, timeout=240)
    second = R.write_config(
        tmp_path / "b.yaml", model_dir, corpus, data={"shuffle": True},
        training={"max_steps": 4, "output_dir": out, "resume_from_checkpoint": "auto",
                  "gradient_accumulation_steps": 2},
    )  # fmt: skip
    resumed = run_distributed(R.train_rank, 1, config=second, timeout=240)[0]
    assert len(resumed["loss"]) == 2  # steps 3 and 4 only
    # one rank sums the batch in another order than two: equal to rounding, not bit for bit
    np.testing.assert_allclose(resumed["loss"], ref["loss"][2:], rtol=0, atol=1e-6)
    np.testing.assert_allclose(resumed["grad_norm"], ref["grad_norm"][2:], rtol=1e-5)
    # the export: transformers reads it and computes the trained model's logits
    exported = R.model_class(str(tmp_path / "whole" / "hf")).from_pretrained(
        str(tmp_path / "whole" / "hf"), dtype=torch.float32
    )
    with torch.no_grad():
        logits = exported(probe).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)
