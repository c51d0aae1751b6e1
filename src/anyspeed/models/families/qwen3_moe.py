"""Qwen3-MoE: the Qwen3 layout (RMSNorm on queries and keys, head_dim 128) with 128 fine-grained
experts, top-8, renormalised over the chosen (Megatron's default routing), no shared expert."""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import LLAMA_MAPPING, Family, tiny
from anyspeed.models.families.moe_hf import (
    QWEN_EXPERT,
    QWEN_MOE,
    check_router,
    qwen_moe_from_hf,
    qwen_moe_to_hf,
)

PRESETS = (
    ModelConfig(
        "qwen3-30b-a3b",
        "qwen3_moe",
        48,
        2048,
        6144,
        32,
        4,
        151936,
        40960,
        1000000.0,
        1e-6,
        kv_channels=128,
        qk_layernorm=True,
        num_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=768,
        moe_aux_loss_coeff=0.001,
    ),
)


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    check_router(model, "qwen3_moe", "Qwen3MoeForCausalLM")
    if model.moe_shared_expert_intermediate_size:
        raise ValueError("qwen3_moe: Qwen3MoeForCausalLM has no shared expert")
    return qwen_moe_to_hf(model)


FAMILY = Family(
    name="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    mapping=LLAMA_MAPPING.extend(
        "qwen3_moe",
        {
            "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        },
        moe={"mlp.router.weight": QWEN_MOE["mlp.router.weight"]},
        expert=QWEN_EXPERT,
    ),
    presets=PRESETS,
    tiny=(
        tiny(
            PRESETS[0],
            "tiny-qwen3-moe",
            kv_channels=32,
            num_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=32,
        ),
    ),
    moe_from_hf=qwen_moe_from_hf,
    moe_to_hf=_to_hf,
    qk_norm=True,
    head_dim_in_config=True,
    attention_bias_key=True,
)
