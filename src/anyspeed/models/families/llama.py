"""LLaMA 2 / 3 / 3.1: RMSNorm, SwiGLU, RoPE (3.1: llama3 scaling), GQA from LLaMA-2-70B on."""

from __future__ import annotations

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import LLAMA_MAPPING, Family, tiny

_LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama(
    name, layers, h, ffn, heads, groups, vocab=32000, maxpos=4096, base=10000.0, scaling=None
) -> ModelConfig:
    return ModelConfig(
        name,
        "llama",
        layers,
        h,
        ffn,
        heads,
        groups,
        vocab,
        maxpos,
        base,
        1e-5,
        rope_scaling=scaling,
    )


PRESETS = (
    _llama("llama2-7b", 32, 4096, 11008, 32, 32),
    _llama("llama2-13b", 40, 5120, 13824, 40, 40),
    _llama("llama2-70b", 80, 8192, 28672, 64, 8),
    _llama("llama3-8b", 32, 4096, 14336, 32, 8, 128256, 8192, 500000.0),
    _llama("llama3-70b", 80, 8192, 28672, 64, 8, 128256, 8192, 500000.0),
    _llama("llama3.1-8b", 32, 4096, 14336, 32, 8, 128256, 131072, 500000.0, _LLAMA31_SCALING),
    _llama("llama3.1-70b", 80, 8192, 28672, 64, 8, 128256, 131072, 500000.0, _LLAMA31_SCALING),
)

FAMILY = Family(
    name="llama",
    hf_architecture="LlamaForCausalLM",
    mapping=LLAMA_MAPPING,
    presets=PRESETS,
    tiny=(
        tiny(PRESETS[0], "tiny-llama2", num_query_groups=4),
        tiny(PRESETS[5], "tiny-llama3", max_position_embeddings=512),
    ),
    attention_bias_key=True,
)
