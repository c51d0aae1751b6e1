"""Qwen1.5-MoE and Qwen2-MoE: the Qwen2 layout (biases on Q, K, V) with fine-grained experts, a
sigmoid-gated shared expert, and softmax over all experts before top-k (no renormalisation)."""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import LLAMA_MAPPING, Family, qkv, tiny
from anyspeed.models.families.moe_hf import (
    QWEN_EXPERT,
    QWEN_MOE,
    check_router,
    qwen_moe_from_hf,
    qwen_moe_to_hf,
)


def _qwen2_moe(
    name, layers, h, ffn, heads, groups, experts, topk, expert_ffn, shared, max_pos
) -> ModelConfig:
    return ModelConfig(
        name,
        "qwen2_moe",
        layers,
        h,
        ffn,
        heads,
        groups,
        151936,
        max_pos,
        1000000.0,
        1e-6,
        add_qkv_bias=True,
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=expert_ffn,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=True,
        moe_router_pre_softmax=True,
        moe_aux_loss_coeff=0.001,
    )


PRESETS = (
    _qwen2_moe("qwen1.5-moe-a2.7b", 24, 2048, 5632, 16, 16, 60, 4, 1408, 5632, 8192),
    _qwen2_moe("qwen2-57b-a14b", 28, 3584, 18944, 28, 4, 64, 8, 2560, 20480, 131072),
)


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    check_router(model, "qwen2_moe", "Qwen2MoeForCausalLM")
    if bool(model.moe_shared_expert_intermediate_size) != model.moe_shared_expert_gate:
        raise ValueError("qwen2_moe: Qwen2MoeForCausalLM's shared expert always has its gate")
    return {**qwen_moe_to_hf(model), "qkv_bias": model.add_qkv_bias}


FAMILY = Family(
    name="qwen2_moe",
    hf_architecture="Qwen2MoeForCausalLM",
    mapping=LLAMA_MAPPING.extend(
        "qwen2_moe",
        {"self_attention.linear_qkv.bias": qkv("self_attn.{}_proj.bias")},
        moe=QWEN_MOE,
        expert=QWEN_EXPERT,
    ),
    presets=PRESETS,
    tiny=(
        tiny(
            PRESETS[0],
            "tiny-qwen2-moe",
            num_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=32,
            moe_shared_expert_intermediate_size=48,
        ),
    ),
    moe_from_hf=qwen_moe_from_hf,
    moe_to_hf=_to_hf,
    qkv_bias=True,
)
