"""A MoE model's family is its source's: fine-tuned from a Hugging Face Qwen3-MoE directory,
the checkpoint records ``qwen3_moe`` (it recorded ``qwen3``, the dense family its flags looked
like, and ``anyspeed convert`` then refused it: "qwen3: its Hugging Face model has no
experts"); a flag-described model with experts is of a MoE family too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_lora_moe import _hf_logits, _run
from test_sft_loss import cli

from anyspeed.commands.convert import main as convert
from anyspeed.models.presets import infer_family


@pytest.mark.parametrize("source", ["qwen3_moe", "glm4_moe"])
def test_finetuned_moe_converts_back_to_transformers(request, source, sft_data, tmp_path):
    """GLM-4.5's layers look like Qwen2-MoE's to the flags (experts, QKV bias, no QK norm):
    only its source tells them apart."""
    if source == "qwen3_moe":
        hf = request.getfixturevalue("tiny_moe")
    else:
        from helpers.convert_ranks import tiny_hf_model

        hf = str(tmp_path / "glm")
        tiny_hf_model(hf, "tiny-glm-4.5", seed=3, vocab_size=768)
        for stand_in in Path(hf).glob("tokenizer*"):  # the data is tokenized
            stand_in.unlink()
    save = str(tmp_path / "ck")
    argv = [*cli(hf, sft_data["padded"], "--save", str(save)), "--lr", "0"]
    _run(hf, argv, 1)
    from anyspeed.checkpoint.reads import read_common, tracked_dir
    from anyspeed.checkpoint.record import model_in_common

    assert model_in_common(read_common(tracked_dir(save)), save, as_hf=False).family == source
    out = str(tmp_path / "hf")
    to_hf = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", save]
    assert convert([*to_hf, "--save-dir", out]) == 0
    tokens = torch.randint(0, 700, (2, 12), generator=torch.Generator().manual_seed(6))
    # lr 0: the weights went through training and conversion unchanged
    assert (_hf_logits(out, tokens) - _hf_logits(hf, tokens)).abs().max() < 1e-5


def test_flags_with_experts_infer_a_moe_family():
    def family(**values: object) -> str:
        return infer_family(values)

    assert family(qk_layernorm=True) == "qwen3"
    assert family(qk_layernorm=True, num_experts=8) == "qwen3_moe"
    assert family(add_qkv_bias=True, num_experts=8) == "qwen2_moe"
    assert family(num_experts=8) == "mixtral"
    assert family(multi_latent_attention=True, qk_layernorm=True, num_experts=8) == "deepseek_v2"
