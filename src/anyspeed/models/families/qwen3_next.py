"""Qwen3-Next (2025): a hybrid decoder. Three of every four layers are gated DeltaNets (linear
attention: a causal convolution, then the gated delta rule, then a SiLU-gated norm), the fourth
full attention with a sigmoid gate on each head's output, RMSNorm on queries and keys and RoPE
on a quarter of each head; every layer's MLP is a high-sparsity MoE (512 experts, top-10) with a
sigmoid-gated shared expert; every norm but the DeltaNet's is zero-centred (``x * (1 + w)``).

Hugging Face keeps each query head next to its gate head in ``q_proj`` and the DeltaNet's
projections grouped per key head (``in_proj_qkvz``, ``in_proj_ba``); Megatron's ``linear_qkv``
holds per query group its query heads, their gates, K and V, and its DeltaNet ``in_proj`` holds
all queries, keys, values, gates, betas, alphas one after another (see ``convert.engine``).
"""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import LLAMA_MAPPING, Family, Fused, every_nth_off, tiny
from anyspeed.models.families.moe_hf import (
    QWEN_EXPERT,
    QWEN_MOE,
    check_router,
    int_of,
    qwen_moe_from_hf,
    qwen_moe_to_hf,
)
from anyspeed.models.hf_rope import hf_rope_parameters

TRAITS = dict(
    kv_channels=256,
    qk_layernorm=True,
    layernorm_zero_centered_gamma=True,
    attention_output_gate=True,
    rotary_percent=0.25,
    experimental_attention_variant="gated_delta_net",
    linear_attention_freq="4",
    moe_shared_expert_gate=True,
    moe_aux_loss_coeff=0.001,
)

PRESETS = (
    ModelConfig(
        "qwen3-next-80b-a3b",
        "qwen3_next",
        48,
        2048,
        5120,
        16,
        2,
        151936,
        262144,
        10000000.0,
        1e-6,
        num_experts=512,
        moe_router_topk=10,
        moe_ffn_hidden_size=512,
        moe_shared_expert_intermediate_size=512,
        **TRAITS,
    ),
)


def _layer_types(config: dict[str, Any], num_layers: int) -> str:
    """``--linear-attention-freq`` for HF's ``layer_types`` (or ``full_attention_interval``)."""
    types = config.get("layer_types")
    if types is None:
        return str(int_of(config, "full_attention_interval", default=4))
    if (
        not isinstance(types, list)
        or len(types) != num_layers
        or not set(types) <= {"linear_attention", "full_attention"}
    ):
        raise ValueError("qwen3_next: config.json layer_types must name each layer's attention")
    return every_nth_off([t == "linear_attention" for t in types])


def rotary_percent(config: dict[str, Any], family: str = "qwen3_next") -> float:
    """The rotated share of each head; ValueError for scaled RoPE (YaRN): Megatron-Core's
    YarnRotaryEmbedding rotates whole heads, Qwen3-Next a part of each."""
    rope = hf_rope_parameters(config, family)
    if rope["rope_type"] != "default":
        raise ValueError(
            f"{family}: rope scaling {rope['rope_type']!r} is not supported (only plain "
            "RoPE: Megatron-Core's YaRN cannot rotate part of a head)"
        )
    return float(rope["partial_rotary_factor"])


def delta_net_from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Which layers are gated DeltaNets, and their sizes (Qwen3-Next's and Qwen3.5's keys)."""
    return dict(
        linear_attention_freq=_layer_types(config, num_layers),
        linear_conv_kernel_dim=int_of(config, "linear_conv_kernel_dim", default=4),
        linear_key_head_dim=int_of(config, "linear_key_head_dim", default=128),
        linear_value_head_dim=int_of(config, "linear_value_head_dim", default=128),
        linear_num_key_heads=int_of(config, "linear_num_key_heads", default=16),
        linear_num_value_heads=int_of(config, "linear_num_value_heads", default=32),
    )


def delta_net_to_hf(model: ModelConfig) -> dict[str, Any]:
    """The HF config keys :func:`delta_net_from_hf` reads."""
    linear = model.linear_attention_layers()
    return {
        "layer_types": ["linear_attention" if x else "full_attention" for x in linear],
        "linear_conv_kernel_dim": model.linear_conv_kernel_dim,
        "linear_key_head_dim": model.linear_key_head_dim,
        "linear_value_head_dim": model.linear_value_head_dim,
        "linear_num_key_heads": model.linear_num_key_heads,
        "linear_num_value_heads": model.linear_num_value_heads,
    }


def _from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if config.get("attention_bias"):
        raise ValueError("qwen3_next: attention_bias=true is not supported")
    return dict(
        qwen_moe_from_hf(config, num_layers),
        kv_channels=int_of(config, "head_dim", default=256),
        rotary_percent=rotary_percent(config),
        layernorm_zero_centered_gamma=True,
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        **delta_net_from_hf(config, num_layers),
    )


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    check_router(model, "qwen3_next", "Qwen3NextForCausalLM")
    want = dict(
        layernorm_zero_centered_gamma=True,
        attention_output_gate=True,
        qk_layernorm=True,
        experimental_attention_variant="gated_delta_net",
        moe_router_pre_softmax=False,
        moe_shared_expert_gate=True,
    )
    wrong = [k for k, v in want.items() if getattr(model, k) != v]
    if wrong or not model.moe_shared_expert_intermediate_size:
        raise ValueError(
            f"qwen3_next: Qwen3NextForCausalLM cannot express "
            f"{wrong or 'a MoE without a shared expert'}"
        )
    return {
        **qwen_moe_to_hf(model),
        "shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
        "partial_rotary_factor": model.rotary_percent,
        **delta_net_to_hf(model),
    }


_DELTA = "linear_attn."
MAPPING = LLAMA_MAPPING.extend(
    "qwen3_next",
    {
        "self_attention.linear_qkv.weight": Fused(
            "qgkv", tuple(f"self_attn.{x}_proj.weight" for x in "qkv")
        ),
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    },
    moe=QWEN_MOE,
    expert=QWEN_EXPERT,
    linear={
        "self_attention.in_proj.weight": Fused(
            "delta_in", (_DELTA + "in_proj_qkvz.weight", _DELTA + "in_proj_ba.weight")
        ),
        "self_attention.conv1d.weight": _DELTA + "conv1d.weight",
        "self_attention.A_log": _DELTA + "A_log",
        "self_attention.dt_bias": _DELTA + "dt_bias",
        "self_attention.out_norm.weight": _DELTA + "norm.weight",
        "self_attention.out_proj.weight": _DELTA + "out_proj.weight",
    },
)

FAMILY = Family(
    name="qwen3_next",
    hf_architecture="Qwen3NextForCausalLM",
    mapping=MAPPING,
    presets=PRESETS,
    tiny=(
        tiny(
            PRESETS[0],
            "tiny-qwen3-next",
            num_layers=4,
            kv_channels=32,
            num_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=32,
            moe_shared_expert_intermediate_size=48,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            max_position_embeddings=512,
        ),
    ),
    moe_from_hf=_from_hf,
    moe_to_hf=_to_hf,
    own_rope=True,
    qk_norm=True,
    head_dim_in_config=True,
    attention_bias_key=True,
)
