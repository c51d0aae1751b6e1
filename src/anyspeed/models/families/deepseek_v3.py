"""DeepSeek-V3: DeepSeek-V2's multi-latent attention with low-rank queries, sigmoid routing
with an aux-loss-free expert bias, group-limited top-k (the top groups by their best two
experts), a routed scaling factor, dense first layers, and multi-token prediction layers that
Hugging Face checkpoints store as decoder layers after the last one."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families import deepseek_v2
from anyspeed.models.families.base import Family, tiny
from anyspeed.models.families.moe_hf import int_of
from anyspeed.models.patterns import pattern_text

PRESETS = (
    ModelConfig(
        "deepseek-v3",
        "deepseek_v3",
        61,
        7168,
        18432,
        128,
        128,
        129280,
        163840,
        10000.0,
        1e-6,
        qk_layernorm=True,
        num_experts=256,
        moe_router_topk=8,
        moe_ffn_hidden_size=2048,
        moe_layer_freq="[0]*3+[1]*58",
        moe_shared_expert_intermediate_size=2048,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
        moe_router_topk_scaling_factor=2.5,
        moe_aux_loss_coeff=1e-4,
        moe_router_load_balancing_type="seq_aux_loss",
        multi_latent_attention=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        rope_type="yarn",
        rotary_scaling_factor=40.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        mtp_num_layers=1,
    ),
)
# Kimi-K2 (moonshotai/Kimi-K2-Base, -Instruct): DeepSeek-V3's architecture (its config.json names
# DeepseekV3ForCausalLM) at 64 heads, 384 experts without group-limited routing, one dense
# layer, YaRN with beta 1/1, and no multi-token prediction layer
PRESETS += (
    replace(
        PRESETS[0],
        name="kimi-k2",
        num_attention_heads=64,
        num_query_groups=64,
        vocab_size=163840,
        max_position_embeddings=131072,
        rotary_base=50000.0,
        num_experts=384,
        moe_layer_freq="[0]*1+[1]*60",
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        moe_router_topk_scaling_factor=2.827,
        moe_aux_loss_coeff=1e-3,
        rotary_scaling_factor=32.0,
        yarn_beta_fast=1.0,
        yarn_beta_slow=1.0,
        mtp_num_layers=None,
    ),
)
# transformers' group scores are each group's top two experts; Megatron's its top-k/group-topk
_GROUP_BEST = 2


def _from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if config.get("quantization_config"):
        raise ValueError(
            "deepseek_v3: the checkpoint is quantised (FP8 blocks): convert it to "
            "bf16 first (DeepSeek's fp8_cast_bf16.py)"
        )
    if config.get("rope_interleave", True) is not True:
        raise ValueError(
            "deepseek_v3: rope_interleave=false is not supported (Megatron's MLA "
            "reads the rotary channels interleaved, as DeepSeek stores them)"
        )
    return dict(
        deepseek_v2.mla_from_hf(config), **router_from_hf(config, num_layers, "deepseek_v3")
    )


def router_from_hf(config: dict[str, Any], num_layers: int, family: str) -> dict[str, Any]:
    """The MoE fields of DeepSeek-V3's routing (also GLM-4.5's): sigmoid scores with an expert
    bias, group-limited top-k, a routed scaling factor, shared experts, dense first layers."""
    if not config.get("norm_topk_prob", True):
        raise ValueError(
            f"{family}: norm_topk_prob=false is not supported (Megatron's "
            "sigmoid router renormalises the top-k weights)"
        )
    experts, topk = int_of(config, "n_routed_experts"), int_of(config, "num_experts_per_tok")
    groups, group_topk = (
        int_of(config, "n_group", default=1),
        int_of(config, "topk_group", default=1),
    )
    limited = 1 < groups and group_topk < groups
    if limited and topk != _GROUP_BEST * group_topk:
        raise ValueError(
            f"{family}: num_experts_per_tok {topk} must be {_GROUP_BEST} x "
            f"topk_group {group_topk} (Megatron ranks groups by their best "
            "top-k/topk_group experts, transformers by their best two)"
        )
    dense = int_of(config, "first_k_dense_replace", default=0)
    expert_ffn = int_of(config, "moe_intermediate_size")
    scale = float(config.get("routed_scaling_factor") or 1.0)
    return dict(
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=expert_ffn,
        moe_layer_freq=pattern_text([int(i >= dense) for i in range(num_layers)]),
        moe_shared_expert_intermediate_size=int_of(config, "n_shared_experts", default=0)
        * expert_ffn
        or None,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if limited else None,
        moe_router_group_topk=group_topk if limited else None,
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
    )


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    check_router(model, "deepseek_v3: DeepseekV3ForCausalLM")
    out = deepseek_v2.moe_to_hf(model, "deepseek_v3", "DeepseekV3ForCausalLM")
    out.update(router_to_hf(model), rope_interleave=True)
    return out


def check_router(model: ModelConfig, name: str) -> None:
    """ValueError when ``model``'s router is not DeepSeek-V3's kind (``name``: the HF model)."""
    if model.moe_router_score_function != "sigmoid" or not model.moe_router_enable_expert_bias:
        raise ValueError(f"{name} routes by sigmoid scores with an expert bias")
    groups, group_topk = model.moe_router_num_groups, model.moe_router_group_topk
    if groups and model.moe_router_topk != _GROUP_BEST * (group_topk or 0):
        raise ValueError(
            f"{name} ranks groups by their best two experts: --moe-router-topk "
            f"must be 2 x --moe-router-group-topk"
        )


def router_to_hf(model: ModelConfig) -> dict[str, Any]:
    """The HF config fields of DeepSeek-V3's routing that :func:`router_from_hf` reads."""
    return dict(
        n_group=model.moe_router_num_groups or 1,
        topk_group=model.moe_router_group_topk or 1,
        norm_topk_prob=True,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        num_nextn_predict_layers=model.mtp_num_layers or 0,
    )


_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
_COPIES = {
    "embed_tokens.weight": "embedding.word_embeddings.weight",
    "shared_head.head.weight": "output_layer.weight",
}
MAPPING = deepseek_v2.MAPPING.extend(
    "deepseek_v3",
    moe={
        **deepseek_v2.MAPPING.moe,
        "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    },
    mtp=_MTP,
    mtp_copies=_COPIES,
)

FAMILY = Family(
    name="deepseek_v3",
    hf_architecture="DeepseekV3ForCausalLM",
    mapping=MAPPING,
    presets=PRESETS,
    tiny=(
        tiny(
            PRESETS[0],
            "tiny-deepseek-v3",
            num_layers=3,
            ffn_hidden_size=96,
            num_query_groups=4,
            num_experts=16,
            moe_router_topk=4,
            moe_ffn_hidden_size=32,
            moe_layer_freq="[0]*1+[1]*2",
            moe_shared_expert_intermediate_size=32,
            moe_router_num_groups=4,
            moe_router_group_topk=2,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_head_dim=16,
            qk_pos_emb_head_dim=8,
            v_head_dim=16,
        ),
        tiny(
            PRESETS[1],
            "tiny-kimi-k2",
            num_layers=3,
            ffn_hidden_size=96,
            num_query_groups=4,
            num_experts=16,
            moe_router_topk=4,
            moe_ffn_hidden_size=32,
            moe_layer_freq="[0]*1+[1]*2",
            moe_shared_expert_intermediate_size=32,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_head_dim=16,
            qk_pos_emb_head_dim=8,
            v_head_dim=16,
        ),
    ),
    moe_from_hf=_from_hf,
    moe_to_hf=_to_hf,
    mla=True,
    qk_norm=True,
)
