"""Model families, one module each: presets, HF traits and the HF <-> Megatron name mapping.

Adding a family is a module here (its presets, its :class:`Family`) and one entry in
:data:`FAMILIES`; the converter's shared engine, the HF config reader and ``--model`` pick it
up from there.
"""

from __future__ import annotations

from anyspeed.models.families import (
    deepseek_v2,
    deepseek_v3,
    deepseek_v32,
    gemma2,
    gemma3,
    glm4_moe,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
)
from anyspeed.models.families.base import (
    ExpertSlice,
    Family,
    FamilyMapping,
    Fused,
    gate_up,
    qkv,
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        llama.FAMILY,
        qwen2.FAMILY,
        qwen3.FAMILY,
        mistral.FAMILY,
        mixtral.FAMILY,
        qwen2_moe.FAMILY,
        qwen3_moe.FAMILY,
        deepseek_v2.FAMILY,
        deepseek_v3.FAMILY,
        deepseek_v32.FAMILY,
        glm4_moe.FAMILY,
        gpt_oss.FAMILY,
        gemma2.FAMILY,
        gemma3.FAMILY,
        phi3.FAMILY,
        qwen3_next.FAMILY,
        qwen3_5.FAMILY,
        qwen3_5.MOE_FAMILY,
    )
}


def mapping_for(family: str) -> FamilyMapping:
    """The HF <-> Megatron tensor-name mapping of ``family``."""
    if family not in FAMILIES:
        raise ValueError(
            f"no conversion mapping for family {family!r} (have {', '.join(sorted(FAMILIES))})"
        )
    return FAMILIES[family].mapping


__all__ = [
    "FAMILIES",
    "ExpertSlice",
    "Family",
    "FamilyMapping",
    "Fused",
    "gate_up",
    "mapping_for",
    "qkv",
]
