"""Qwen2 / Qwen2.5: the LLaMA layout plus biases on Q, K and V; small sizes tie embeddings."""

from __future__ import annotations

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import LLAMA_MAPPING, Family, qkv, tiny


def _qwen2(
    name, layers, h, ffn, heads, groups, vocab=151936, maxpos=32768, tie=False, base=1000000.0
) -> ModelConfig:
    return ModelConfig(
        name,
        "qwen2",
        layers,
        h,
        ffn,
        heads,
        groups,
        vocab,
        maxpos,
        base,
        1e-6,
        add_qkv_bias=True,
        tie_embeddings=tie,
    )


PRESETS = (
    _qwen2("qwen2-0.5b", 24, 896, 4864, 14, 2, maxpos=131072, tie=True),
    _qwen2("qwen2-1.5b", 28, 1536, 8960, 12, 2, maxpos=131072, tie=True),
    _qwen2("qwen2-7b", 28, 3584, 18944, 28, 4, vocab=152064, maxpos=131072),
    _qwen2("qwen2-72b", 80, 8192, 29568, 64, 8, vocab=152064, maxpos=131072),
    _qwen2("qwen2.5-0.5b", 24, 896, 4864, 14, 2, tie=True),
    _qwen2("qwen2.5-1.5b", 28, 1536, 8960, 12, 2, tie=True),
    _qwen2("qwen2.5-3b", 36, 2048, 11008, 16, 2, tie=True),
    _qwen2("qwen2.5-7b", 28, 3584, 18944, 28, 4, vocab=152064, maxpos=131072),
    _qwen2("qwen2.5-14b", 48, 5120, 13824, 40, 8, vocab=152064, maxpos=131072),
    _qwen2("qwen2.5-32b", 64, 5120, 27648, 40, 8, vocab=152064, maxpos=131072),
    _qwen2("qwen2.5-72b", 80, 8192, 29568, 64, 8, vocab=152064, maxpos=131072),
)

FAMILY = Family(
    name="qwen2",
    hf_architecture="Qwen2ForCausalLM",
    mapping=LLAMA_MAPPING.extend(
        "qwen2", {"self_attention.linear_qkv.bias": qkv("self_attn.{}_proj.bias")}
    ),
    presets=PRESETS,
    tiny=(tiny(PRESETS[4], "tiny-qwen2.5"),),
    qkv_bias=True,
)
