"""GPT-OSS (OpenAI, 2025): MoE in every layer (top-k on biased router logits, softmax over the
chosen), experts with biases and a clamped quick-GELU GLU with a +1 offset on the linear half,
a learnable attention sink per head, sliding-window (128) and full layers alternating, biases on
Q, K, V and O, YaRN RoPE. Hugging Face stores each layer's experts stacked, fc1's gate and up
columns interleaved (see :mod:`anyspeed.convert.expert_slices`)."""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import (
    LLAMA_MAPPING,
    ExpertSlice,
    Family,
    qkv,
    tiny,
    window_skip_freq,
)
from anyspeed.models.families.moe_hf import int_of
from anyspeed.models.hf_rope import (
    DEFAULT_MAX_POSITIONS,
    gpt_yarn,
    hf_rope_parameters,
    yarn_mscales_to_hf,
)

ALPHA = 1.702  # the GLU's sigmoid slope: Megatron's quick-GELU
_TRAITS = dict(
    add_bias_linear=True,
    softmax_type="learnable",
    window_attn_skip_freq="2",
    swiglu=False,
    quick_geglu=True,
    glu_linear_offset=1.0,
    activation_func_clamp_value=7.0,
    position_embedding_type="yarn",
    rotary_scaling_factor=32.0,
    yarn_correction_range_round_to_int=False,
    moe_router_topk=4,
    moe_aux_loss_coeff=0.001,
)


def _preset(name: str, layers: int, experts: int) -> ModelConfig:
    return ModelConfig(
        name,
        "gpt_oss",
        layers,
        2880,
        2880,
        64,
        8,
        201088,
        131072,
        150000.0,
        1e-5,
        kv_channels=64,
        window_size=127,
        num_experts=experts,
        moe_ffn_hidden_size=2880,
        add_qkv_bias=True,
        **_TRAITS,
    )


PRESETS = (_preset("gpt-oss-20b", 24, 32), _preset("gpt-oss-120b", 36, 128))


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    rope = hf_rope_parameters(config, "gpt_oss")
    if rope["rope_type"] != "yarn":
        raise ValueError("gpt_oss: only YaRN rope_parameters are supported")
    return gpt_yarn(
        rope, "gpt_oss", int_of(config, "max_position_embeddings", default=DEFAULT_MAX_POSITIONS)
    )


def _from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if config.get("quantization_config"):
        raise ValueError(
            "gpt_oss: the checkpoint is quantised (MXFP4): dequantise it first with "
            "transformers (from_pretrained with Mxfp4Config(dequantize=True), save_pretrained)"
        )
    if float(config.get("swiglu_alpha", ALPHA)) != ALPHA:
        raise ValueError(
            f"gpt_oss: swiglu_alpha {config['swiglu_alpha']} is not supported "
            f"(Megatron's quick-GELU fixes it to {ALPHA})"
        )
    window = config.get("sliding_window")
    ffn = int_of(config, "intermediate_size")
    return dict(
        num_experts=int_of(config, "num_local_experts"),
        moe_router_topk=int_of(config, "num_experts_per_tok"),
        moe_ffn_hidden_size=ffn,
        moe_aux_loss_coeff=float(config.get("router_aux_loss_coef") or 0.0),
        add_bias_linear=True,
        softmax_type="learnable",
        window_size=None if window is None else int_of(config, "sliding_window") - 1,
        window_attn_skip_freq=None
        if window is None
        else window_skip_freq(config.get("layer_types"), num_layers, "gpt_oss"),
        swiglu=False,
        quick_geglu=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(config.get("swiglu_limit", 7.0)),
        **_rope(config),
    )


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    want = dict(
        add_bias_linear=True,
        softmax_type="learnable",
        quick_geglu=True,
        glu_linear_offset=1.0,
        position_embedding_type="yarn",
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_shared_expert_intermediate_size=None,
    )
    wrong = [k for k, v in want.items() if getattr(model, k) != v]
    if wrong or not all(model.moe_layers()) or model.activation_func_clamp_value is None:
        raise ValueError(f"gpt_oss: GptOssForCausalLM cannot express {wrong or 'this MLP'}")
    window = model.window_layers()
    return {
        "num_local_experts": model.num_experts,
        "num_experts_per_tok": model.moe_router_topk,
        "intermediate_size": model.expert_ffn_size,
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
        "sliding_window": None if model.window_size is None else model.window_size + 1,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in window],
        "swiglu_limit": model.activation_func_clamp_value,
        "swiglu_alpha": ALPHA,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": model.rotary_base,
            "factor": model.rotary_scaling_factor,
            "original_max_position_embeddings": model.yarn_original_max_position_embeddings,
            "beta_fast": model.yarn_beta_fast,
            "beta_slow": model.yarn_beta_slow,
            "truncate": model.yarn_correction_range_round_to_int,
            **yarn_mscales_to_hf(model),
        },
    }


_EXPERTS = "mlp.experts.local_experts.{e}."
MAPPING = LLAMA_MAPPING.extend(
    "gpt_oss",
    {
        "self_attention.linear_qkv.bias": qkv("self_attn.{}_proj.bias"),
        "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
        "self_attention.core_attention.softmax_offset": "self_attn.sinks",
    },
    moe={"mlp.router.weight": "mlp.router.weight", "mlp.router.bias": "mlp.router.bias"},
    expert={
        _EXPERTS + "linear_fc1.weight": ExpertSlice("mlp.experts.gate_up_proj", "gate_up_t"),
        _EXPERTS + "linear_fc1.bias": ExpertSlice("mlp.experts.gate_up_proj_bias", "gate_up"),
        _EXPERTS + "linear_fc2.weight": ExpertSlice("mlp.experts.down_proj", "t"),
        _EXPERTS + "linear_fc2.bias": ExpertSlice("mlp.experts.down_proj_bias", "same"),
    },
)

FAMILY = Family(
    name="gpt_oss",
    hf_architecture="GptOssForCausalLM",
    mapping=MAPPING,
    presets=PRESETS,
    tiny=(
        tiny(
            PRESETS[0],
            "tiny-gpt-oss",
            kv_channels=16,
            ffn_hidden_size=32,
            num_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=32,
            window_size=3,
            yarn_original_max_position_embeddings=64,
            rotary_scaling_factor=4.0,
            max_position_embeddings=256,
        ),
    ),
    moe_from_hf=_from_hf,
    moe_to_hf=_to_hf,
    qkv_bias=True,
    own_rope=True,
    head_dim_in_config=True,
    attention_bias_key=True,
)
