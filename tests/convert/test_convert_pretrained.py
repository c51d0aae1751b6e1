"""Checkpoints ``anyspeed pretrain`` wrote from flags (no ``--model``) convert to Hugging Face
with ``anyspeed convert`` alone: the architecture comes from the checkpoint's model record.

A tiny model (2 layers, hidden 64, mock data, one process, 3 iterations) is trained and saved;
``anyspeed convert`` without ``--hf-cfg-dir`` must give an HF directory whose ``transformers``
logits equal those of Megatron's GPTModel built from the *flags* (not from the record) and
loaded with Megatron's own ``dist_checkpointing.load``. A checkpoint holding the model under
the key older anyspeed pretrain runs wrote (``anyspeed_args``) still resumes and converts.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anyspeed.commands.convert import main as convert_main
from anyspeed.convert.verify import hf_logits
from anyspeed.testing import run_distributed
from helpers import convert_ranks

ATOL = 1e-4
ITER = "iter_0000003"


def _flags(iters: int) -> list[str]:
    return [
        "--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--ffn-hidden-size", "128", "--seq-length", "16", "--max-position-embeddings", "16",
        "--vocab-size", "128", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--init-method-std", "0.2", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", str(iters), "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
        "--no-progress-bar", "--seed", "3",
    ]  # fmt: skip


def _pretrain(argv: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "anyspeed", "pretrain", *argv],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The checkpoint, and the architecture the flags describe (parsed as pretrain parses
    them, independently of what the checkpoint recorded)."""
    from anyspeed.stages.prepare import prepare

    root = tmp_path_factory.mktemp("pretrained")
    ck = root / "ck"
    _pretrain(_flags(3) + ["--save", str(ck), "--save-interval", "3"])
    run, _ = prepare(_flags(3), "launcher")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    return ck, run.model, tokens


def _converts(ck: Path, out: Path, model, tokens) -> None:
    """``anyspeed convert`` mg -> hf without --hf-cfg-dir; transformers' logits of the result
    equal Megatron's of the checkpoint."""
    argv = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(ck),
            "--save-dir", str(out)]  # fmt: skip
    assert convert_main(argv) == 0
    want = run_distributed(convert_ranks.checkpoint_logits, 1, ckpt=str(ck),
                           model=model.to_dict(), tokens=tokens)[0]  # fmt: skip
    got = hf_logits(out, tokens)
    assert want.std() > 0.1  # logits worth comparing
    assert got.shape == want[..., : got.shape[-1]].shape
    diff = float((got - want[..., : got.shape[-1]].float()).abs().max())
    assert diff <= ATOL, f"max-abs logits difference {diff:.3g}"


def test_pretrain_from_flags_converts_without_hf_cfg_dir(trained, tmp_path):
    from anyspeed.checkpoint.reads import read_common
    from anyspeed.checkpoint.record import MODEL_KEY, read_model

    ck, model, tokens = trained
    assert MODEL_KEY in read_common(ck) and "anyspeed_args" not in read_common(ck)
    assert read_model(ck) == model
    _converts(ck, tmp_path / "hf", model, tokens)


def _with_old_key(ck: Path, old: Path) -> Path:
    """A copy of checkpoint ``ck`` whose common state names the model as anyspeed pretrain did
    before the one record: ``anyspeed_args``, no ``anyspeed_model``."""
    shutil.copytree(ck, old)
    common_pt = old / ITER / "common.pt"
    common = torch.load(common_pt, weights_only=False)
    common["anyspeed_args"] = common.pop("anyspeed_model")
    torch.save(common, common_pt)
    return old


def test_checkpoint_with_the_old_model_key_converts(trained, tmp_path):
    """The common state as anyspeed pretrain wrote it before the one record: the model under
    ``anyspeed_args``, no ``anyspeed_model``."""
    from anyspeed.commands.session import model_of

    ck, model, tokens = trained
    old = _with_old_key(ck, tmp_path / "old")
    assert model_of(str(old)) == model  # what generate / evaluate read
    _converts(old, tmp_path / "hf", model, tokens)


@pytest.mark.slow
def test_checkpoint_with_the_old_model_key_resumes(trained, tmp_path):
    """Such a checkpoint also resumes (the position and the weights: the record is not read)."""
    ck, _, _ = trained
    old = _with_old_key(ck, tmp_path / "old")
    out = _pretrain(_flags(4) + ["--load", str(old)])
    assert f"loaded {old} at iteration 3" in out.stdout
    steps = [line for line in out.stdout.splitlines() if line.startswith(" iteration")]
    assert len(steps) == 1 and steps[0].split("|")[0].split() == ["iteration", "4/4"], steps
