"""``anyspeed pretrain --load <HF dir>`` of a tiny random Qwen3-Next model (three gated DeltaNet
layers, then one gated full-attention layer; zero-centred norms, a quarter of each head rotated,
a MoE with a gated shared expert): the first loss equals transformers' loss on the same batch
within 1e-5 at ``--optimization-level`` 1 (and 0, ``-m slow``); at TP2 with sequence
parallelism, PP2 and EP2 the loss and grad norm equal the one-process run within 1e-5 over
three steps (``-m slow``; the TP2 row needs the DeltaNet's output-norm gradient summed over the
TP ranks: that norm is whole on each rank while each rank holds other heads)."""

from __future__ import annotations

import pytest
import torch
from test_pretrain import _close, run_many, write_corpus
from test_pretrain_hf import hf_first_loss

COMMON = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--train-iters", "3", "--lr", "1e-3", "--split", "100,0,0", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
          "--no-progress-bar"]  # fmt: skip
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "ep2": [
        "--expert-model-parallel-size",
        "2",
        "--num-experts",
        "4",
        "--moe-token-dispatcher-type",
        "alltoall",
    ],  # fmt: skip
}


def tiny_qwen3_next():
    """A random Qwen3-Next model; norms, decays and gates random too, so each one shows."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, shared_expert_intermediate_size=48, num_hidden_layers=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    model = Qwen3NextForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.2 * noise if "norm" in name else 0.05 * noise)
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next_train")
    corpus = write_corpus(str(root / "c_text_document"), docs=120)
    model = tiny_qwen3_next()
    model.save_pretrained(str(root / "hf"))
    argv = ["--load", str(root / "hf"), "--data-path", corpus, *COMMON]
    (one,) = run_many(1, [argv + ["--optimization-level", "1", "--save", str(root / "l1")]])
    return model, argv, {"level1": one}, root


def test_first_loss_equals_transformers(runs, monkeypatch):
    model, argv, one, _ = runs
    want, _ = hf_first_loss(model, argv, monkeypatch)
    assert one["level1"]["loss"][0] == pytest.approx(want, rel=1e-5)


@pytest.mark.slow  # one more process run: Megatron's own attention and kernels
def test_first_loss_equals_transformers_at_level0(runs, monkeypatch, tmp_path):
    model, argv, _, _ = runs
    (run,) = run_many(1, [argv + ["--optimization-level", "0", "--save", str(tmp_path / "l0")]])
    want, _ = hf_first_loss(model, argv, monkeypatch)
    assert run["loss"][0] == pytest.approx(want, rel=1e-5)


@pytest.fixture(scope="module")
def layouts(runs):
    _, argv, _, root = runs
    two = run_many(2, [argv + flags + ["--save", str(root / name)]
                       for name, flags in LAYOUTS.items()])  # fmt: skip
    return dict(zip(LAYOUTS, two, strict=True))


@pytest.mark.slow  # three two-process runs (TP2 is in CI through the conversion's TP2 logits)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_one_process(runs, layouts, layout):
    _close(layouts[layout]["loss"], runs[2]["level1"]["loss"])
    _close(layouts[layout]["grad_norm"], runs[2]["level1"]["grad_norm"])


@pytest.mark.slow  # one more process run; the spelling's model is checked in CI by
# tests/models/test_mindspeed_next_flags.py against the same transformers config
def test_mindspeed_spelling_from_hf_gives_transformers_loss(runs, monkeypatch, tmp_path):
    """MindSpeed-LLM's qwen3_next recipe flags (its spelling: --full-attention-interval,
    --partial-rotary-factor, --add-rmsnorm-offset, --mamba-d-conv, --moe-router-pre-softmax
    with --norm-topk-prob, ...) over --load <HF dir>: they agree with the model and the first
    loss is transformers'."""
    model, argv, _, _ = runs
    spelling = ("--full-attention-interval 4 --mamba-d-conv 4 --mamba-expand 1 "
                "--partial-rotary-factor 0.25 --add-rmsnorm-offset --no-enable-linear-qkv "
                "--rmsnorm-weight-in-fp32 --shared-expert-gate --norm-topk-prob "
                "--moe-router-pre-softmax --moe-router-load-balancing-type aux_loss "
                "--topk-softmax-in-fp32 --mamba-chunk-size 64 --use-triton-gdn "
                "--loss-compute-mode default --loss-chunk-size 1024 --spec "
                "mindspeed_llm.tasks.models.spec.qwen3_next_spec layer_spec").split()  # fmt: skip
    flags = [*argv, *spelling]
    (run,) = run_many(1, [flags + ["--save", str(tmp_path / "ms")]])
    want, _ = hf_first_loss(model, argv, monkeypatch)
    assert run["loss"][0] == pytest.approx(want, rel=1e-5)
