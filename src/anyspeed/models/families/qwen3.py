"""Qwen3 (dense): the LLaMA layout plus RMSNorm on queries and keys; head_dim 128 throughout."""

from __future__ import annotations

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import LLAMA_MAPPING, Family, tiny


def _qwen3(name, layers, h, ffn, heads, groups, tie=False) -> ModelConfig:
    return ModelConfig(
        name,
        "qwen3",
        layers,
        h,
        ffn,
        heads,
        groups,
        151936,
        40960,
        1000000.0,
        1e-6,
        kv_channels=128,
        qk_layernorm=True,
        tie_embeddings=tie,
    )


PRESETS = (
    _qwen3("qwen3-0.6b", 28, 1024, 3072, 16, 8, tie=True),
    _qwen3("qwen3-1.7b", 28, 2048, 6144, 16, 8, tie=True),
    _qwen3("qwen3-4b", 36, 2560, 9728, 32, 8, tie=True),
    _qwen3("qwen3-8b", 36, 4096, 12288, 32, 8),
    _qwen3("qwen3-14b", 40, 5120, 17408, 40, 8),
    _qwen3("qwen3-32b", 64, 5120, 25600, 64, 8),
)

FAMILY = Family(
    name="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    mapping=LLAMA_MAPPING.extend(
        "qwen3",
        {
            "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        },
    ),
    presets=PRESETS,
    tiny=(tiny(PRESETS[0], "tiny-qwen3", kv_channels=32),),
    qk_norm=True,
    head_dim_in_config=True,
)
