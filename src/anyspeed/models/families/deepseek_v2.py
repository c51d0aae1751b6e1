"""DeepSeek-V2(-Lite): multi-latent attention (low-rank KV with a shared rotary key, YaRN RoPE),
the first layer dense, then fine-grained experts with always-on shared experts and softmax over
all experts before top-k (no renormalisation)."""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import Family, FamilyMapping, gate_up, tiny
from anyspeed.models.families.moe_hf import QWEN_EXPERT, int_of
from anyspeed.models.hf_rope import (
    DEFAULT_MAX_POSITIONS,
    hf_rope_parameters,
    yarn_factor,
    yarn_mscales,
)
from anyspeed.models.patterns import pattern_text

# transformers' YaRN defaults for the keys a DeepSeek config may leave out
_YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}

PRESETS = (
    ModelConfig(
        "deepseek-v2-lite",
        "deepseek_v2",
        27,
        2048,
        10944,
        16,
        16,
        102400,
        163840,
        10000.0,
        1e-6,
        qk_layernorm=True,
        num_experts=64,
        moe_router_topk=6,
        moe_ffn_hidden_size=1408,
        moe_layer_freq="[0]*1+[1]*26",
        moe_shared_expert_intermediate_size=2 * 1408,
        moe_router_pre_softmax=True,
        moe_aux_loss_coeff=0.001,
        multi_latent_attention=True,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        rope_type="yarn",
        rotary_scaling_factor=40.0,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
)


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    params = hf_rope_parameters(config, "deepseek_v2")
    kind = params["rope_type"]
    if kind == "default":
        return {"rope_type": "rope"}
    if kind != "yarn":
        raise ValueError(f"deepseek_v2: rope scaling {kind!r} is not supported (rope or yarn)")
    yarn = {k: params.get(k) or v for k, v in _YARN_DEFAULTS.items()}
    mscale, all_dim = yarn_mscales(params, "deepseek_v2")
    positions = int_of(config, "max_position_embeddings", default=DEFAULT_MAX_POSITIONS)
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=yarn_factor(params, positions),
        mscale=mscale,
        mscale_all_dim=all_dim,
        yarn_original_max_position_embeddings=int(yarn["original_max_position_embeddings"]),
        yarn_beta_fast=float(yarn["beta_fast"]),
        yarn_beta_slow=float(yarn["beta_slow"]),
    )


def mla_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """The multi-latent attention fields (and YaRN) of a DeepSeek-V2/V3 config."""
    return dict(
        multi_latent_attention=True,
        qk_layernorm=True,  # kv_a_layernorm: Megatron builds it only with QK norm
        q_lora_rank=int_of(config, "q_lora_rank", default=0) or None,
        kv_lora_rank=int_of(config, "kv_lora_rank"),
        qk_head_dim=int_of(config, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=int_of(config, "qk_rope_head_dim"),
        v_head_dim=int_of(config, "v_head_dim"),
        kv_channels=None,
        num_query_groups=None,
        moe_aux_loss_coeff=float(config.get("aux_loss_alpha") or 0.0),
        **_rope(config),
    )


def _from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if (
        config.get("topk_method", "greedy") != "greedy"
        or config.get("scoring_func", "softmax") != "softmax"
    ):
        raise ValueError("deepseek_v2: only greedy top-k over softmax scores is supported")
    dense = int_of(config, "first_k_dense_replace", default=0)
    shared = int_of(config, "n_shared_experts", default=0)
    expert_ffn = int_of(config, "moe_intermediate_size")
    scale = float(config.get("routed_scaling_factor") or 1.0)
    return dict(
        mla_from_hf(config),
        num_experts=int_of(config, "n_routed_experts"),
        moe_router_topk=int_of(config, "num_experts_per_tok"),
        moe_ffn_hidden_size=expert_ffn,
        moe_layer_freq=pattern_text([int(i >= dense) for i in range(num_layers)]),
        moe_shared_expert_intermediate_size=shared * expert_ffn or None,
        moe_router_pre_softmax=not config.get("norm_topk_prob", False),
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
    )


def moe_to_hf(model: ModelConfig, family: str, hf_name: str) -> dict[str, Any]:
    """The DeepSeek config fields V2 and V3 share: dense layers first, whole shared experts,
    multi-latent attention, YaRN, the routed scaling factor."""
    out = experts_to_hf(model, family, hf_name)
    out.update(
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_nope_head_dim=model.qk_head_dim,
        qk_rope_head_dim=model.qk_pos_emb_head_dim,
        v_head_dim=model.v_head_dim,
        num_key_value_heads=model.num_attention_heads,
    )
    if model.rope_type == "yarn":
        out["rope_scaling"] = {
            "type": "yarn",
            "factor": model.rotary_scaling_factor,
            "mscale": model.mscale,
            "mscale_all_dim": model.mscale_all_dim,
            "original_max_position_embeddings": model.yarn_original_max_position_embeddings,
            "beta_fast": model.yarn_beta_fast,
            "beta_slow": model.yarn_beta_slow,
        }
    return out


def experts_to_hf(model: ModelConfig, family: str, hf_name: str) -> dict[str, Any]:
    """DeepSeek's expert fields (also GLM-4.5's): dense layers first, then experts in every
    layer, whole shared experts without a gate, the routed scaling factor."""
    bits = model.moe_layers()
    dense = bits.index(True) if True in bits else model.num_layers
    if any(not b for b in bits[dense:]) or model.moe_shared_expert_gate:
        raise ValueError(
            f"{family}: {hf_name} has dense layers first, then "
            "experts in every layer, and no shared-expert gate"
        )
    shared = model.moe_shared_expert_intermediate_size or 0
    if shared % model.expert_ffn_size:
        raise ValueError(f"{family}: the shared experts must be whole experts")
    out: dict[str, Any] = {
        "n_routed_experts": model.num_experts,
        "num_experts_per_tok": model.moe_router_topk,
        "moe_intermediate_size": model.expert_ffn_size,
        "first_k_dense_replace": dense,
        "n_shared_experts": shared // model.expert_ffn_size,
        "routed_scaling_factor": model.moe_router_topk_scaling_factor or 1.0,
    }
    return out


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    if model.moe_router_score_function != "softmax" or model.moe_router_num_groups:
        raise ValueError("deepseek_v2: DeepseekV2ForCausalLM routes by softmax over all experts")
    out = moe_to_hf(model, "deepseek_v2", "DeepseekV2ForCausalLM")
    out.update(topk_method="greedy", norm_topk_prob=not model.moe_router_pre_softmax)
    return out


_ATTN = "self_attention."
MAPPING = FamilyMapping(
    family="deepseek_v2",
    top={
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    },
    layer={
        "input_layernorm.weight": "input_layernorm.weight",
        _ATTN + "linear_q_proj.weight": "self_attn.q_proj.weight",
        # with a q_lora_rank, instead of linear_q_proj (the engine keeps the ones that exist)
        _ATTN + "linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
        _ATTN + "q_layernorm.weight": "self_attn.q_a_layernorm.weight",
        _ATTN + "linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
        _ATTN + "linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
        _ATTN + "kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
        _ATTN + "linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
        _ATTN + "linear_proj.weight": "self_attn.o_proj.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.weight": gate_up("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    },
    moe={
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.shared_experts.linear_fc1.weight": gate_up(
            "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"
        ),
        "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
    },
    expert=QWEN_EXPERT,
)

FAMILY = Family(
    name="deepseek_v2",
    hf_architecture="DeepseekV2ForCausalLM",
    mapping=MAPPING,
    presets=PRESETS,
    tiny=(
        tiny(
            PRESETS[0],
            "tiny-deepseek-v2-lite",
            num_layers=3,
            ffn_hidden_size=96,
            num_query_groups=4,
            num_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=32,
            moe_layer_freq="[0]*1+[1]*2",
            moe_shared_expert_intermediate_size=64,
            kv_lora_rank=32,
            qk_head_dim=16,
            qk_pos_emb_head_dim=8,
            v_head_dim=16,
        ),
    ),
    moe_from_hf=_from_hf,
    moe_to_hf=_to_hf,
    mla=True,
    qk_norm=True,  # Megatron's MLA has the latent KV norm only with --qk-layernorm
)
