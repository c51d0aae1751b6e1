"""GLM-4.5 trained and generated from a tiny random ``Glm4MoeForCausalLM`` (QK norm, Q/K/V
biases, RoPE on half of each head, sigmoid routing with the expert bias and a routed scaling
factor, a shared expert, a dense first layer): ``anyspeed pretrain --load <HF dir>``'s first
loss equals transformers' loss within 1e-5 (fp32), and with ``-m slow`` TP2+SP, PP2 and EP2
equal the one-process run within 1e-5 over three steps."""

from __future__ import annotations

import pytest
import torch
from test_pretrain import _close, run_many, write_corpus
from test_pretrain_hf import hf_first_loss

from helpers import convert_ranks

COMMON = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--train-iters", "3", "--lr", "1e-3", "--split", "100,0,0", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
          "--no-progress-bar"]  # fmt: skip
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--num-layer-list", "2,1"],
    "ep2": ["--expert-model-parallel-size", "2", "--num-experts", "8",
            "--moe-token-dispatcher-type", "alltoall"],
}  # fmt: skip
# ~45 s: kept out of CI's budget; the fast twin is tests/convert/test_convert_glm4_moe.py (the
# forward against transformers' logits)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm_train")
    corpus = write_corpus(str(root / "c_text_document"), docs=120)
    convert_ranks.tiny_hf_model(root / "hf", "tiny-glm-4.5", seed=8)
    for stand_in in ("tokenizer.json", "tokenizer_config.json"):  # token ids only
        (root / "hf" / stand_in).unlink(missing_ok=True)
    argv = ["--load", str(root / "hf"), "--data-path", corpus, *COMMON]
    (one,) = run_many(1, [argv + ["--save", str(root / "one")]])
    return root, argv, one


def test_first_loss_equals_transformers(runs, monkeypatch):
    from transformers import AutoModelForCausalLM

    root, argv, one = runs
    model = AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()
    model.config._attn_implementation = "sdpa"  # attention_mask None: causal
    want, _ = hf_first_loss(model, argv, monkeypatch)
    assert one["loss"][0] == pytest.approx(want, rel=1e-5)
    assert len(set(one["loss"])) == 3  # it trains


def test_layouts_equal_one_process(runs, tmp_path):
    _, argv, one = runs
    argvs = [argv + flags + ["--save", str(tmp_path / name)] for name, flags in LAYOUTS.items()]
    for run in run_many(2, argvs):  # in LAYOUTS' order
        _close(run["loss"], one["loss"])
        _close(run["grad_norm"], one["grad_norm"])
