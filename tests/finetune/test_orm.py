"""The outcome reward model: trained from a converted HF model, saved, exported as
transformers' ``*ForSequenceClassification`` (one label), whose own scores give the same loss
and rewards as anyspeed's forward on the same pairs; ``--verify`` compares per-token scores."""

from __future__ import annotations

import math

import pytest
import torch
from test_dpo import TOL, cli, mean

from anyspeed.testing import run_distributed
from helpers import sft_ranks
from helpers.corpora import read_back


def hf_scores(hf_dir: str, prefix: str) -> tuple[list[float], list[float]]:
    """transformers' own sequence-classification score of every chosen and rejected
    sequence, one at a time (no padding: the score is the last token's)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    out = []
    for side in ("chosen", "rejected"):
        with torch.no_grad():
            ids = read_back(f"{prefix}_packed_{side}_input_ids_document")
            out.append([float(model(input_ids=torch.tensor([i])).logits[0, 0]) for i in ids])
    return out[0], out[1]


@pytest.fixture(scope="module")
def orm_run(pair_data, tiny_qwen, tmp_path_factory) -> dict:
    """3 ORM steps saved, then one step at learning rate 0 from the saved model (its metrics
    are the saved model's scores), and the export."""
    from anyspeed.convert import hf_cache as hf_load
    from anyspeed.convert import megatron_to_hf, verify

    d = tmp_path_factory.mktemp("orm")
    train = cli(tiny_qwen, pair_data, "--save", str(d / "ck"), "--save-interval", "3",
                stage="orm", iters=3)  # fmt: skip
    score = cli(str(d / "ck"), pair_data, "--lr", "0", stage="orm", iters=1)
    score = hf_load.expand(score, tiny_qwen)  # the architecture flags of the saved model
    runs = run_distributed(sft_ranks.posttrain_many, 1, argv=train, clis=[train, score],
                           timeout=300)[0]  # fmt: skip
    hf = megatron_to_hf(d / "ck", d / "hf", tiny_qwen)
    diff = verify(str(hf), str(d / "ck"), tolerance=1e-4)
    return {"train": runs[0], "score": runs[1], "hf": str(hf), "verify": diff}


def test_orm_learns_to_rank(orm_run):
    m = orm_run["train"]["metrics"]
    assert orm_run["train"]["loss"][-1] < orm_run["train"]["loss"][0]
    assert m["rewards/margins"][-1] > m["rewards/margins"][0]


def test_export_scores_equal_transformers(orm_run, pair_data):
    sc, sr = hf_scores(orm_run["hf"], pair_data)
    m = orm_run["score"]["metrics"]
    assert m["rewards/chosen"][0] == pytest.approx(mean(sc), abs=TOL)
    assert m["rewards/rejected"][0] == pytest.approx(mean(sr), abs=TOL)
    want = mean([math.log1p(math.exp(-(a - b))) for a, b in zip(sc, sr, strict=True)])
    assert orm_run["score"]["loss"][0] == pytest.approx(want, abs=TOL)
    acc = mean([float(a > b) for a, b in zip(sc, sr, strict=True)])
    assert m["rewards/accuracies"][0] == pytest.approx(acc)
    assert orm_run["verify"] < 1e-5
