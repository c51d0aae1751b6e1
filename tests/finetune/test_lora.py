"""LoRA on Megatron's column/row-parallel layers: zero-B adapters leave the model as it was,
only r x (in + out) parameters per target train, TP2+SP trains like TP1, resume is exact and
a LoRA checkpoint holds the adapters only."""

from __future__ import annotations

import os

import pytest
import torch
from test_sft_loss import cli

from anyspeed.models import get_preset
from anyspeed.testing import run_distributed
from helpers import lora_ranks, sft_ranks

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def expected_lora_params(preset: str, r: int) -> int:
    """Sum over layers and targets of r x (in + out), from the architecture alone."""
    m = get_preset(preset)
    head = m.kv_channels or m.hidden_size // m.num_attention_heads
    kv = m.num_query_groups or m.num_attention_heads
    qkv_out = (m.num_attention_heads + 2 * kv) * head
    fc1_out = m.ffn_hidden_size * (2 if m.swiglu else 1)
    per_layer = (
        r * (m.hidden_size + qkv_out)  # linear_qkv
        + r * (m.num_attention_heads * head + m.hidden_size)  # linear_proj
        + r * (m.hidden_size + fc1_out)  # linear_fc1
        + r * (m.ffn_hidden_size + m.hidden_size)  # linear_fc2
    )
    return m.num_layers * per_layer


def test_zero_b_is_the_base_model_and_counts_params():
    preset, r = "tiny-qwen2.5", 4
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    out = run_distributed(
        lora_ranks.zero_b_logits, 1, preset=preset, targets=TARGETS, r=r, tokens=tokens, timeout=300
    )[0]
    assert torch.equal(out["before"], out["after"])
    assert not torch.allclose(out["before"], out["moved"])  # the adapters are in the path
    assert out["trainable"] == expected_lora_params(preset, r)
    assert all(".lora_" in n for n in out["names"])
    assert not any("base_layer" in n for n in out["base_names"])  # names kept for checkpoints


def lora_cli(hf: str, prefix: str, *extra: str) -> list[str]:
    base = cli(
        hf, prefix, "--lora-r", "4", "--lora-alpha", "8", "--lora-target-modules", *TARGETS, *extra
    )
    return [
        ("4" if a == "1" and base[i - 1] == "--train-iters" else a) for i, a in enumerate(base)
    ] + ["--lr", "1e-2"]


@pytest.fixture(scope="module")
def runs(sft_data, tiny_qwen, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("lora")
    whole = lora_cli(tiny_qwen, sft_data["padded"])
    first = lora_cli(
        tiny_qwen,
        sft_data["padded"],
        "--save",
        str(d / "half"),
        "--save-interval",
        "2",
        "--exit-interval",
        "2",
    )
    rest = lora_cli(tiny_qwen, sft_data["padded"], "--lora-load", str(d / "half"))
    one = run_distributed(
        sft_ranks.posttrain_many, 1, argv=whole, clis=[whole, first, rest], timeout=600
    )[0]
    tp2 = lora_cli(
        tiny_qwen, sft_data["padded"], "--tensor-model-parallel-size", "2", "--sequence-parallel"
    )
    two = run_distributed(sft_ranks.posttrain, 2, argv=tp2, cli=tp2, timeout=600)[0]
    return {"tp1": one[0], "first": one[1], "rest": one[2], "tp2": two, "dir": d / "half"}


@pytest.mark.slow
def test_lora_tp2_sp_equals_tp1(runs):
    assert runs["tp1"]["loss"][-1] < runs["tp1"]["loss"][0]  # the adapters learn
    assert runs["tp2"]["loss"] == pytest.approx(runs["tp1"]["loss"], rel=1e-5)
    assert runs["tp2"]["grad_norm"] == pytest.approx(runs["tp1"]["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_lora_resume_is_exact_and_small(runs):
    assert runs["first"]["iterations"] == [1, 2] and runs["rest"]["iterations"] == [3, 4]
    assert runs["first"]["loss"] + runs["rest"]["loss"] == pytest.approx(
        runs["tp1"]["loss"], rel=1e-6
    )
    from megatron.core import dist_checkpointing

    it = runs["dir"] / "iter_0000002"
    keys = [
        k
        for k in dist_checkpointing.load_tensors_metadata(str(it))
        if not k.startswith("optimizer.")
    ]
    assert keys and all(".lora_" in k for k in keys)
    size = sum(f.stat().st_size for f in it.rglob("*") if f.is_file())
    assert size < 400_000, size  # adapters + their Adam state; the base model alone is ~1.2 MB
    assert os.path.isdir(it)
