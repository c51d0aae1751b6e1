"""GLM-4.5 and GLM-4.5-Air (``Glm4MoeForCausalLM``): grouped-query attention with biases on
Q, K and V, RoPE on the first half of each head (rotate-half, as LLaMA), optional RMSNorm on
queries and keys (GLM-4.5 has it, Air not); DeepSeek-V3's experts and routing (sigmoid scores
with an expert bias, a routed scaling factor, one shared expert, dense first layers) and its
multi-token prediction layer, stored as the HF layer after the last."""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families import deepseek_v3
from anyspeed.models.families.base import LLAMA_MAPPING, Family, qkv, tiny
from anyspeed.models.families.deepseek_v2 import MAPPING as DEEPSEEK_V2
from anyspeed.models.families.deepseek_v2 import experts_to_hf
from anyspeed.models.hf_rope import hf_rope_parameters

_GLM = dict(
    kv_channels=128,
    add_qkv_bias=True,
    rotary_percent=0.5,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_aux_loss_coeff=1e-3,
    moe_router_load_balancing_type="seq_aux_loss",
    mtp_num_layers=1,
)
PRESETS = (
    ModelConfig(
        "glm-4.5",
        "glm4_moe",
        92,
        5120,
        12288,
        96,
        8,
        151552,
        131072,
        1000000.0,
        1e-5,
        qk_layernorm=True,
        num_experts=160,
        moe_router_topk=8,
        moe_ffn_hidden_size=1536,
        moe_layer_freq="[0]*3+[1]*89",
        moe_shared_expert_intermediate_size=1536,
        moe_router_topk_scaling_factor=2.5,
        **_GLM,
    ),
    ModelConfig(
        "glm-4.5-air",
        "glm4_moe",
        46,
        4096,
        10944,
        96,
        8,
        151552,
        131072,
        1000000.0,
        1e-5,
        num_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=1408,
        moe_layer_freq="[0]*1+[1]*45",
        moe_shared_expert_intermediate_size=1408,
        **_GLM,
    ),
)
NAME = "glm4_moe: Glm4MoeForCausalLM"
# both models' traits at a size a CPU trains in seconds (no MTP layer: the tests add one)
_TINY = dict(
    num_layers=3,
    kv_channels=32,
    ffn_hidden_size=96,
    num_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_layer_freq="[0]*1+[1]*2",
    moe_shared_expert_intermediate_size=32,
    mtp_num_layers=None,
)


def _from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    rope = hf_rope_parameters(config, "glm4_moe")
    if rope["rope_type"] not in (None, "default"):
        raise ValueError(f"glm4_moe: rope scaling {rope['rope_type']!r} is not supported")
    return dict(
        deepseek_v3.router_from_hf(config, num_layers, "glm4_moe"),
        qk_layernorm=bool(config.get("use_qk_norm", False)),
        add_qkv_bias=bool(config.get("attention_bias", False)),
        rotary_percent=float(rope.get("partial_rotary_factor", 1.0)),
    )


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    deepseek_v3.check_router(model, NAME)
    if model.multi_latent_attention or model.rope_scaling:
        raise ValueError(f"{NAME} has grouped-query attention with plain RoPE")
    out = experts_to_hf(model, "glm4_moe", "Glm4MoeForCausalLM")
    out.update(deepseek_v3.router_to_hf(model))
    out.pop("topk_method"), out.pop("scoring_func")  # DeepSeek's keys, not GLM's
    out.update(use_qk_norm=model.qk_layernorm, partial_rotary_factor=model.rotary_percent)
    return out


MAPPING = LLAMA_MAPPING.extend(
    "glm4_moe",
    {
        "self_attention.linear_qkv.bias": qkv("self_attn.{}_proj.bias"),
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    },
    moe={**DEEPSEEK_V2.moe, "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias"},
    expert=DEEPSEEK_V2.expert,
    mtp=deepseek_v3.MAPPING.mtp,
    mtp_copies=deepseek_v3.MAPPING.mtp_copies,
)

FAMILY = Family(
    name="glm4_moe",
    hf_architecture="Glm4MoeForCausalLM",
    mapping=MAPPING,
    presets=PRESETS,
    tiny=(
        tiny(PRESETS[0], "tiny-glm-4.5", **_TINY),
        tiny(PRESETS[1], "tiny-glm-4.5-air", **_TINY),
    ),
    moe_from_hf=_from_hf,
    moe_to_hf=_to_hf,
    qkv_bias=True,
    head_dim_in_config=True,
    attention_bias_key=True,
    attention_traits_in_config=True,
)
