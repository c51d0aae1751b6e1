"""The model Megatron-LM's stored ``args`` describe, and the family ``--model-type-hf`` names.

Megatron-LM's ``pretrain_gpt.py`` (with or without the one line) stores its parsed ``args``,
whose architecture fields are Megatron-LM's argument names (anyspeed's own record:
:mod:`.record`). The HF family is not in the args (LLaMA and Mistral share them):
``--model-type-hf`` names it, else the closest family is inferred.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from anyspeed.checkpoint.errors import ModelRecordError
from anyspeed.models.config import ModelConfig
from anyspeed.models.families import FAMILIES
from anyspeed.models.presets import model_from_args

# MindSpeed-LLM's --model-type-hf names -> family.
MODEL_TYPE_HF = {
    "llama2": "llama",
    "llama3": "llama",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen25": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "mixtral",
    "qwen2-moe": "qwen2_moe",
    "qwen2_moe": "qwen2_moe",
    "qwen3-moe": "qwen3_moe",
    "qwen3_moe": "qwen3_moe",
    "deepseek2-lite": "deepseek_v2",
    "deepseek_v2": "deepseek_v2",
    "deepseek3": "deepseek_v3",
    "deepseek_v3": "deepseek_v3",
    "gpt-oss": "gpt_oss",
    "gpt_oss": "gpt_oss",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "gemma3_text": "gemma3_text",
    "phi3": "phi3",
    "phi3.5": "phi3",
    "phi4": "phi3",
}

# What every supported HF family is: Megatron-LM argument -> the value it must have.
_REQUIRED = {
    "position_embedding_type": "rope",
    "normalization": "RMSNorm",
    "swiglu": True,
    "add_bias_linear": False,
}


def family_for(model_type_hf: str) -> str:
    """The family ``--model-type-hf`` names; ModelRecordError listing the choices otherwise."""
    family = MODEL_TYPE_HF.get(model_type_hf.lower())
    if family is None:
        raise ModelRecordError(
            f"--model-type-hf {model_type_hf}: choose from {', '.join(MODEL_TYPE_HF)}"
        )
    return family


def megatron_lm_model(
    args: argparse.Namespace, where: str | Path, model_type_hf: str | None = None
) -> ModelConfig:
    """The architecture Megatron-LM's stored ``args`` describe (its argument names), in the
    family ``model_type_hf`` names; ModelRecordError naming the argument when none fits."""
    for name, want in _REQUIRED.items():
        have = getattr(args, name, None)
        if have != want:
            raise ModelRecordError(
                f"{where}: the checkpoint's args have {name}={have!r}; the supported HF "
                f"families need {want!r}"
            )
    values: dict[str, Any] = dict(vars(args))
    # ModelConfig's flag table reads flag names; Megatron-LM stores these two under others.
    values["disable_bias_linear"] = not args.add_bias_linear
    values.setdefault("norm_epsilon", getattr(args, "layernorm_epsilon", 1e-5))
    values["model"] = None
    # Left unset (None), --rope-type is Megatron-Core's default: YaRN for MLA, else RoPE.
    if values.get("rope_type") is None:
        values["rope_type"] = "yarn" if values.get("multi_latent_attention") else "rope"
    # Megatron-LM stores zero-centred norms under TransformerConfig's name.
    values.setdefault("apply_layernorm_1p", getattr(args, "layernorm_zero_centered_gamma", False))
    window = values.get("window_size")
    if isinstance(window, (tuple, list)):  # Megatron-LM stores (left, right)
        if len(window) != 2 or window[1] != 0:
            raise ModelRecordError(f"{where}: window_size {window}: only causal windows load")
        values["window_size"] = int(window[0])
    if not isinstance(values.get("padded_vocab_size"), int):
        raise ModelRecordError(f"{where}: the checkpoint's args have no padded_vocab_size")
    try:
        model = model_from_args(argparse.Namespace(**values))
    except (TypeError, ValueError) as exc:
        raise ModelRecordError(f"{where}: the checkpoint's args: {exc}") from None
    if model.kv_channels == model.hidden_size // model.num_attention_heads:
        model = dataclasses.replace(model, kv_channels=None)  # Megatron-LM stores the default
    if model_type_hf:
        model = dataclasses.replace(model, family=family_for(model_type_hf))
    return check_family(model, where, model_type_hf)


def check_family(model: ModelConfig, where: str | Path, model_type_hf: str | None) -> ModelConfig:
    """``model`` when its family's traits (QKV bias, QK norm) match it, else ModelRecordError."""
    if model_type_hf and family_for(model_type_hf) != model.family:
        raise ModelRecordError(
            f"--model-type-hf {model_type_hf}: {where} holds a {model.family} model"
        )
    traits = FAMILIES[model.family]
    if traits.attention_traits_in_config:
        return model
    for have, want, arg in (
        (model.add_qkv_bias, traits.qkv_bias, "add_qkv_bias"),
        (model.qk_layernorm, traits.qk_norm, "qk_layernorm"),
    ):
        if have != want:
            raise ModelRecordError(
                f"{where}: {model.family} models have {arg}={want}, the checkpoint's args "
                f"{have} (pass the right --model-type-hf)"
            )
    return model
