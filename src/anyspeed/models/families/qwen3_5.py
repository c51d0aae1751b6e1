"""Qwen3.5 (2026), the text models (``Qwen3_5ForCausalLM``, ``qwen3_5_text``, and the MoE
``Qwen3_5MoeForCausalLM``, ``qwen3_5_moe_text``, whose MLPs are Qwen3-Next's experts):
Qwen3-Next's hybrid decoder (gated DeltaNets with full attention every fourth layer, output-
gated attention with QK norm and RoPE on a quarter of each head, zero-centred norms) with a
dense MLP, and the DeltaNet's input projections kept apart in Hugging Face's layout
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, which Megatron's ``in_proj``
holds one after another). Its rotary embedding is multimodal RoPE; text positions are the same
on its three axes, which is plain RoPE."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families import qwen3_next
from anyspeed.models.families.base import Family, Fused
from anyspeed.models.families.moe_hf import (
    QWEN_EXPERT,
    QWEN_MOE,
    check_router,
    int_of,
    qwen_moe_from_hf,
)

_DELTA = "linear_attn."
_TRAITS = {k: v for k, v in qwen3_next.TRAITS.items() if not k.startswith("moe_")}


def _from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if config.get("attention_bias"):
        raise ValueError("qwen3_5_text: attention_bias=true is not supported")
    return dict(
        kv_channels=int_of(config, "head_dim", default=256),
        rotary_percent=qwen3_next.rotary_percent(config, "qwen3_5_text"),
        layernorm_zero_centered_gamma=True,
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        **qwen3_next.delta_net_from_hf(config, num_layers),
    )


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    sizes = ("kv_channels", "rotary_percent", "linear_attention_freq")
    wrong = [k for k, v in _TRAITS.items() if k not in sizes and getattr(model, k) != v]
    if wrong:
        raise ValueError(f"qwen3_5_text: Qwen3_5ForCausalLM cannot express {wrong}")
    return {"partial_rotary_factor": model.rotary_percent, **qwen3_next.delta_net_to_hf(model)}


MAPPING = replace(
    qwen3_next.MAPPING.extend("qwen3_5_text", moe={}, expert={}),
    linear={
        **qwen3_next.MAPPING.linear,
        "self_attention.in_proj.weight": Fused(
            "delta_in_flat",
            tuple(_DELTA + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
        ),
    },
)

# The text models of the published checkpoints (Qwen's model cards; transformers' default
# configurations are "Qwen3.5-9B style" and "Qwen3.5-35B-A3B style"). The checkpoints also hold a
# vision tower and a multi-token-prediction layer, which these text models leave out.
_LINEAR = dict(
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
)
PRESETS = (
    ModelConfig(
        "qwen3.5-9b",
        "qwen3_5_text",
        32,
        4096,
        12288,
        16,
        4,
        248320,
        262144,
        10000000.0,
        1e-6,
        **dict(_TRAITS, kv_channels=256),
        **_LINEAR,
    ),
)
_TINY = ModelConfig(
    "tiny-qwen3.5",
    "qwen3_5_text",
    4,
    64,
    96,
    4,
    2,
    512,
    512,
    10000000.0,
    1e-6,
    **dict(_TRAITS, kv_channels=32),
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)

FAMILY = Family(
    name="qwen3_5_text",
    hf_architecture="Qwen3_5ForCausalLM",
    mapping=MAPPING,
    presets=PRESETS,
    tiny=(_TINY,),
    dense_from_hf=_from_hf,
    dense_to_hf=_to_hf,
    own_rope=True,
    qk_norm=True,
    head_dim_in_config=True,
    attention_bias_key=True,
)


def _moe_from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3.5-MoE: experts in every layer with a sigmoid-gated shared expert, softmax then
    top-k renormalised (its config has no ``norm_topk_prob``: it always renormalises)."""
    moe = qwen_moe_from_hf(config, num_layers)
    moe.update(moe_router_pre_softmax=False, moe_shared_expert_gate=True)
    return dict(_from_hf(config, num_layers), **moe)


def _moe_to_hf(model: ModelConfig) -> dict[str, Any]:
    check_router(model, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")
    every = all(model.moe_layers())
    shared = model.moe_shared_expert_intermediate_size
    if not every or model.moe_router_pre_softmax or not (shared and model.moe_shared_expert_gate):
        raise ValueError(
            "qwen3_5_moe_text: Qwen3_5MoeForCausalLM has experts in every layer, renormalised "
            "top-k and a gated shared expert"
        )
    return {
        **_to_hf(replace(model, num_experts=None)),
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.moe_router_topk,
        "moe_intermediate_size": model.expert_ffn_size,
        "shared_expert_intermediate_size": shared,
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
    }


MOE_FAMILY = Family(
    name="qwen3_5_moe_text",
    hf_architecture="Qwen3_5MoeForCausalLM",
    mapping=replace(MAPPING, family="qwen3_5_moe_text", moe=QWEN_MOE, expert=QWEN_EXPERT),
    presets=(
        replace(
            PRESETS[0],
            name="qwen3.5-35b-a3b",
            family="qwen3_5_moe_text",
            num_layers=40,
            hidden_size=2048,
            num_query_groups=2,
            num_experts=256,
            moe_router_topk=8,
            moe_ffn_hidden_size=512,
            moe_shared_expert_intermediate_size=512,
            moe_shared_expert_gate=True,
            moe_aux_loss_coeff=0.001,
        ),
    ),
    tiny=(
        replace(
            _TINY,
            name="tiny-qwen3.5-moe",
            family="qwen3_5_moe_text",
            num_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=32,
            moe_shared_expert_intermediate_size=48,
            moe_shared_expert_gate=True,
            moe_aux_loss_coeff=0.001,
        ),
    ),
    moe_from_hf=_moe_from_hf,
    moe_to_hf=_moe_to_hf,
    own_rope=True,
    qk_norm=True,
    head_dim_in_config=True,
    attention_bias_key=True,
)
