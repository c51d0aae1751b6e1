"""``anyspeed convert --lora-load``: the adapters of a TP2 LoRA run merged into the base weights
give, in transformers, the logits anyspeed computes with base + adapters; exported with
``--save-lora-to-hf``, PEFT loads them onto the base HF model with the same logits."""

from __future__ import annotations

import glob

import pytest
import torch
from test_lora import lora_cli

from anyspeed.commands.convert import main as convert
from anyspeed.testing import run_distributed
from helpers import lora_ranks, sft_ranks

TOL = 1e-4


@pytest.fixture(scope="module")
def trained(sft_data, tiny_qwen, tmp_path_factory) -> dict:
    """Two LoRA steps at TP2+SP saved; the base (converted) and LoRA checkpoints, and the
    logits of base + adapters in anyspeed (one process)."""
    d = tmp_path_factory.mktemp("export")
    argv = lora_cli(
        tiny_qwen,
        sft_data["padded"],
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--save",
        str(d / "lora"),
        "--save-interval",
        "2",
        "--exit-interval",
        "2",
    )
    run_distributed(sft_ranks.posttrain, 2, argv=argv, cli=argv, timeout=600)
    base = glob.glob(str(d / "lora" / "from-hf-*"))[0]
    tokens = torch.randint(0, 600, (2, 24), generator=torch.Generator().manual_seed(1))
    again = lora_cli(
        tiny_qwen, sft_data["padded"], "--lora-load", str(d / "lora"), "--train-iters", "2"
    )
    logits = run_distributed(
        lora_ranks.trained_logits, 1, argv=again, cli=again, tokens=tokens, timeout=600
    )[0]
    return {"dir": d, "base": base, "lora": str(d / "lora"), "tokens": tokens, "logits": logits}


def _export(trained: dict, out: str, *flags: str) -> int:
    """``anyspeed convert`` mg -> hf of the base checkpoint with the LoRA checkpoint."""
    argv = [
        "--load-model-type",
        "mg",
        "--save-model-type",
        "hf",
        "--load-dir",
        trained["base"],
        "--save-dir",
        out,
        "--lora-load",
        trained["lora"],
        *flags,
    ]
    return convert(argv)


def _hf_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


@pytest.mark.slow
def test_merged_export_matches_anyspeed(trained, tiny_qwen):
    from transformers import AutoModelForCausalLM

    out = str(trained["dir"] / "merged")
    flags = ["--hf-cfg-dir", tiny_qwen, "--lora-r", "4", "--lora-alpha", "8"]
    assert _export(trained, out, *flags) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen, torch_dtype=torch.float32).eval()
    want = trained["logits"][..., : merged.config.vocab_size].float()
    got = _hf_logits(merged, trained["tokens"])
    assert (got - want).abs().max() < TOL
    assert (_hf_logits(base, trained["tokens"]) - want).abs().max() > 100 * TOL  # it trained


@pytest.mark.slow
def test_peft_loads_the_adapter_export(trained, tiny_qwen):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = str(trained["dir"] / "peft")
    assert _export(trained, out, "--save-lora-to-hf") == 0
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out).eval()
    want = trained["logits"][..., : base.config.vocab_size].float()
    assert (_hf_logits(model, trained["tokens"]) - want).abs().max() < TOL


def test_lora_flags_need_a_megatron_source(capsys, tmp_path):
    rc = convert(
        [
            "--load-model-type",
            "hf",
            "--save-model-type",
            "mg",
            "--load-dir",
            str(tmp_path),
            "--save-dir",
            str(tmp_path / "o"),
            "--lora-load",
            "x",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--load-model-type mg" in err


def test_lora_load_flags_must_match_the_checkpoint(tmp_path):
    from anyspeed.convert.errors import ConvertError
    from anyspeed.convert.lora import Adapters
    from anyspeed.models.lora import LoraRecord

    adapters = Adapters.__new__(Adapters)  # only the recorded config is consulted
    adapters.dir = str(tmp_path)
    adapters.record = LoraRecord.of(4, 8.0, ["linear_proj", "linear_qkv"])
    adapters.check(4, 8, ["linear_qkv", "linear_proj"])  # same values, other spelling
    with pytest.raises(ConvertError, match="trained with --lora-r 4, not 8"):
        adapters.check(8, None, None)
    with pytest.raises(ConvertError, match="--lora-target-modules"):
        adapters.check(None, None, ["linear_fc1"])
