"""``anyspeed convert --lora-load`` and ``--save-lora-to-hf`` at a tiny size, fast.

The LoRA checkpoint is made without training (``helpers.lora_ranks.adapter_checkpoint``: the
converted base model, adapters with a random B, saved as posttrain saves them), so the two
user-facing paths run in seconds; ``test_lora_export.py`` checks them after a real TP2 run
(slow). The reference is independent of the code under test: Megatron's forward with the
adapters attached (base + scale * B A x by forward hook) against transformers' forward of the
merged export, and against PEFT applying the exported adapter onto the base HF model. For
a Qwen model and a Phi-3 one (queries, keys and values in one HF projection: one adapter on
``qkv_proj``, its B in HF's row order; gate and up in ``gate_up_proj``).
"""

from __future__ import annotations

import pytest
import torch

from anyspeed.commands.convert import main as convert
from helpers import lora_ranks

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
R, ALPHA = 4, 8.0
TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen", "phi3"])
def ckpts(request, tiny_qwen, tmp_path_factory) -> dict:
    from helpers.convert_ranks import tiny_hf_model

    d = tmp_path_factory.mktemp("lora_quick")
    hf = tiny_qwen
    if request.param == "phi3":
        hf = str(d / "hf")
        tiny_hf_model(hf, "tiny-phi3", seed=3)
    base, lora = str(d / "base"), str(d / "lora")
    hf_to_mg = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf]
    assert convert([*hf_to_mg, "--save-dir", base]) == 0
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = lora_ranks.adapter_checkpoint(base, lora, TARGETS, R, ALPHA, tokens)
    return {"dir": d, "base": base, "lora": lora, "tokens": tokens, "logits": logits, "hf": hf}


def _export(ckpts: dict, out: str, *flags: str) -> int:
    return convert(
        [
            "--load-model-type",
            "mg",
            "--save-model-type",
            "hf",
            "--load-dir",
            ckpts["base"],
            "--save-dir",
            out,
            "--lora-load",
            ckpts["lora"],
            *flags,
        ]
    )


def _logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits.float()


def test_merged_export_gives_the_adapted_logits(ckpts):
    from transformers import AutoModelForCausalLM

    out = str(ckpts["dir"] / "merged")
    assert _export(ckpts, out, "--hf-cfg-dir", ckpts["hf"], "--lora-r", str(R)) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(ckpts["hf"], torch_dtype=torch.float32)
    want = ckpts["logits"][..., : merged.config.vocab_size].float()
    assert (_logits(merged, ckpts["tokens"]) - want).abs().max() < TOL
    assert (_logits(base, ckpts["tokens"]) - want).abs().max() > 100 * TOL  # adapters count


def test_peft_applies_the_adapter_export(ckpts):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = str(ckpts["dir"] / "peft")
    assert _export(ckpts, out, "--save-lora-to-hf") == 0
    base = AutoModelForCausalLM.from_pretrained(ckpts["hf"], torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out)
    want = ckpts["logits"][..., : base.config.vocab_size].float()
    assert (_logits(model, ckpts["tokens"]) - want).abs().max() < TOL
