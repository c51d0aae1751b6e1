"""Model presets: the architecture of published LLM families as Megatron-LM flags.

``--model NAME`` fills the architecture flags of a LLaMA-2/3/3.1, Qwen2/2.5, Qwen3 (dense) or
Mistral model; flags given explicitly on the command line override the preset. The presets live
with their family (:mod:`anyspeed.models.families`); ``tiny-<family>`` presets keep every
architectural trait of the family at a size that trains on a laptop CPU.
"""

from __future__ import annotations

import argparse
from typing import Any

from anyspeed.argv import merge_flags, pop_flag
from anyspeed.models.config import ModelConfig
from anyspeed.models.families import FAMILIES
from anyspeed.models.hf import HF_ARCHITECTURES, hf_family, preset_from_hf  # noqa: F401

PRESETS: dict[str, ModelConfig] = {
    p.name: p for family in FAMILIES.values() for p in family.presets
}
PRESETS.update({p.name: p for family in FAMILIES.values() for p in family.tiny})


def get_preset(name: str) -> ModelConfig:
    """The preset called ``name`` (case-insensitive); a clear error lists the choices."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"--model {name}: unknown preset (choose from {', '.join(PRESETS)})")
    return PRESETS[key]


def apply_preset(argv: list[str]) -> list[str]:
    """Expand ``--model NAME`` in ``argv`` into the preset's flags; explicit flags win."""
    name, rest = pop_flag(argv, "--model")
    if name is None:
        return list(argv)
    return merge_flags(get_preset(name).megatron_args(), rest)


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    """The architecture checked pretraining ``args`` describe: of the preset's family with
    ``--model``, else of the family closest to the flags."""
    name = getattr(args, "model", None)
    family = get_preset(name).family if name else infer_family(ModelConfig.flag_values(args))
    return ModelConfig.from_args(args, family)


def infer_family(values: dict[str, Any]) -> str:
    """The HF family closest to a flag-described model: the attention variant (gated DeltaNet
    layers: Qwen3-Next; sparse attention: DeepSeek-V3.2), sandwich norms (Gemma 2), LongRoPE
    (Phi-3), attention
    sinks (GPT-OSS), multi-latent
    attention and experts first (a Qwen3 with experts is a Qwen3-MoE), then QK norm, then QKV
    bias."""
    bias, norm = bool(values.get("add_qkv_bias")), bool(values.get("qk_layernorm"))
    post_norm = bool(values.get("post_norm"))
    longrope = values.get("longrope_long_factor") is not None
    sinks = values.get("softmax_type", "vanilla") != "vanilla"
    variant = values.get("experimental_attention_variant")
    mla, moe = bool(values.get("multi_latent_attention")), bool(values.get("num_experts"))

    def distance(f: Any) -> tuple[bool, ...]:
        family_sinks = any(p.softmax_type != "vanilla" for p in f.presets)
        variants = {p.experimental_attention_variant for p in f.presets} or {None}
        family_moe = any(p.num_experts for p in f.presets)
        return (
            variant not in variants,
            any(p.post_norm for p in f.presets) != post_norm,
            any(p.longrope for p in f.presets) != longrope,
            family_sinks != sinks,
            bool(f.mla) != mla,
            family_moe != moe,
            f.qk_norm != norm,
            f.qkv_bias != bias,
        )

    ranked = sorted(FAMILIES.values(), key=distance)
    return ranked[0].name  # sorted() is stable: registry order breaks ties
