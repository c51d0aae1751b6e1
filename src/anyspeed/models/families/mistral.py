"""Mistral 7B: the LLaMA layout with GQA, a 32k context and RoPE base 1e6."""

from __future__ import annotations

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import LLAMA_MAPPING, Family, tiny

PRESETS = (
    ModelConfig("mistral-7b", "mistral", 32, 4096, 14336, 32, 8, 32000, 32768, 1000000.0, 1e-5),
)

FAMILY = Family(
    name="mistral",
    hf_architecture="MistralForCausalLM",
    mapping=LLAMA_MAPPING.extend("mistral"),
    presets=PRESETS,
    tiny=(tiny(PRESETS[0], "tiny-mistral"),),
    head_dim_in_config=True,
)
