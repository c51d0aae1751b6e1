"""Gemma 2, Gemma 3 and Phi-3 (LongRoPE past its pretraining length, RoPE on part of each head,
a window) trained from tiny random transformers models: ``anyspeed pretrain --load <HF dir>``'s
first loss equals transformers' loss (Gemma 2: eager attention, soft-capped scores) within 1e-5
(fp32), and (``-m slow``) TP2 with sequence parallelism, PP2 with uneven stages
(2, 1) and DP2 at ``--optimization-level 0`` (Megatron's own attention core; the default
level's blocked kernel caps the scores itself) equal the one-process run within 1e-5 over three
steps: loss and grad norm, so the sandwich norms' gradients are reduced over TP under sequence
parallelism. Kept out of CI's time budget: its fast twins are the conversion tests (the
forward against transformers' logits) and the memory tests' tiny-gemma2 runs (five training
steps through the trainer)."""

from __future__ import annotations

import pytest
import torch
from test_pretrain import _close, run_many, write_corpus
from test_pretrain_hf import hf_first_loss
from test_qwen3_next_training import COMMON

from helpers import convert_ranks

LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--num-layer-list", "2,1"],
    "dp2-level0": ["--optimization-level", "0"],
}


pytestmark = pytest.mark.slow  # ~16 s a family; CI's fast twins: below


@pytest.fixture(scope="module", params=["tiny-gemma2", "tiny-gemma3", "tiny-phi3"])
def runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    corpus = write_corpus(str(root / "c_text_document"), docs=120)
    convert_ranks.tiny_hf_model(root / "hf", request.param, seed=8)
    for stand_in in ("tokenizer.json", "tokenizer_config.json"):  # token ids only
        (root / "hf" / stand_in).unlink(missing_ok=True)
    argv = ["--load", str(root / "hf"), "--data-path", corpus, *COMMON]
    (one,) = run_many(1, [argv + ["--save", str(root / "one")]])
    return root, argv, one


def test_first_loss_equals_transformers(runs, monkeypatch):
    from transformers import AutoModelForCausalLM

    root, argv, one = runs
    model = AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()
    if getattr(
        model.config, "attn_logit_softcapping", None
    ):  # Gemma 2: transformers' soft-capping path
        assert model.config._attn_implementation == "eager"
    want, _ = hf_first_loss(model, argv, monkeypatch)
    assert one["loss"][0] == pytest.approx(want, rel=1e-5)
    assert len(set(one["loss"])) == 3  # it trains


def test_layouts_equal_one_process(runs, tmp_path):
    _, argv, one = runs
    argvs = [argv + flags + ["--save", str(tmp_path / name)] for name, flags in LAYOUTS.items()]
    for run in run_many(2, argvs):  # in the layouts' order
        _close(run["loss"], one["loss"])
        _close(run["grad_norm"], one["grad_norm"])


@pytest.mark.parametrize("algo", ["p2p", "a2a"], ids=["ring", "ulysses"])
def test_longrope_at_cp2_equals_one_process(tmp_path, algo):
    """Phi-3.5's LongRoPE (no window: context parallelism refuses windows) at CP2, ring and
    Ulysses: each rank rotates its slice of the sequence by the long set the whole length
    picks, cos and sin scaled by the attention factor."""
    corpus = write_corpus(str(tmp_path / "c_text_document"), docs=120)
    convert_ranks.tiny_hf_model(tmp_path / "hf", "tiny-phi3", seed=8, sliding_window=None)
    for stand_in in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / stand_in).unlink(missing_ok=True)
    argv = ["--load", str(tmp_path / "hf"), "--data-path", corpus, *COMMON]
    cp = ["--context-parallel-size", "2", "--context-parallel-algo",
          {"p2p": "megatron_cp_algo", "a2a": "ulysses_cp_algo"}[algo]]  # fmt: skip
    (one,) = run_many(1, [argv + ["--save", str(tmp_path / "one")]])
    (two,) = run_many(2, [argv + cp + ["--save", str(tmp_path / "cp")]])
    _close(two["loss"], one["loss"])
    _close(two["grad_norm"], one["grad_norm"])
