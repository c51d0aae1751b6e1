"""Gemma 2 (Google, 2024): a dense GQA model with sliding-window (4,096) and full attention
alternating, tanh soft-capping of the attention scores (50) and of the output logits (30),
scores scaled by ``query_pre_attn_scalar``, norms before and after attention and MLP, all as
``x * (1 + w)``, a GLU with tanh-approximated GELU, embeddings scaled by sqrt(hidden) and tied
to the output layer (see :mod:`anyspeed.models.gemma` for how each runs)."""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import LLAMA_MAPPING, Family, tiny, window_skip_freq
from anyspeed.models.families.moe_hf import int_of

ACT = "gelu_pytorch_tanh"  # transformers' name for F.gelu(approximate="tanh")
_TRAITS = dict(
    kv_channels=None,
    tie_embeddings=True,
    swiglu=False,
    gelu_tanh=True,
    post_norm=True,
    layernorm_zero_centered_gamma=True,
    input_embeds_norm=True,
    window_size=4095,
    window_attn_skip_freq="2",
    attn_logit_softcapping=50.0,
    output_logit_softcapping=30.0,
)


def _gemma2(name, layers, h, ffn, heads, groups, head_dim, scalar) -> ModelConfig:
    traits = dict(_TRAITS, kv_channels=head_dim, query_pre_attn_scalar=float(scalar))
    return ModelConfig(
        name, "gemma2", layers, h, ffn, heads, groups, 256000, 8192, 10000.0, 1e-6, **traits
    )


PRESETS = (
    _gemma2("gemma2-2b", 26, 2304, 9216, 8, 4, 256, 256),
    _gemma2("gemma2-9b", 42, 3584, 14336, 16, 8, 256, 256),
    _gemma2("gemma2-27b", 46, 4608, 36864, 32, 16, 128, 144),
)


def _cap(config: dict[str, Any], key: str) -> float | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"config.json {key} is {value!r:.40}, not a positive number or null")
    return float(value)


def read_gemma(
    config: dict[str, Any], num_layers: int, family: str, pattern: int = 2
) -> dict[str, Any]:
    """The ModelConfig fields of Gemma 2's layer (shared with Gemma 3) from an HF config;
    without ``layer_types`` (configs older than transformers' field) every ``pattern``-th
    layer is full attention, as transformers reads them."""
    act = config.get("hidden_activation") or config.get("hidden_act") or ACT
    if act != ACT:
        raise ValueError(f"{family}: hidden_activation {act!r} is not supported (only {ACT})")
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{family}: use_bidirectional_attention is not supported (causal only)")
    window = config.get("sliding_window")
    scalar = config.get("query_pre_attn_scalar")
    if scalar is not None and (isinstance(scalar, bool) or not isinstance(scalar, (int, float))):
        raise ValueError(f"config.json query_pre_attn_scalar is {scalar!r:.40}, not a number")
    traits = {k: v for k, v in _TRAITS.items() if k != "kv_channels"}
    types = config.get("layer_types")
    if types is None:
        full = [(i + 1) % pattern == 0 for i in range(num_layers)]
        types = ["full_attention" if f else "sliding_attention" for f in full]
    return dict(
        traits,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        window_size=None if window is None else int_of(config, "sliding_window") - 1,
        window_attn_skip_freq=None
        if window is None
        else window_skip_freq(types, num_layers, family),
        attn_logit_softcapping=_cap(config, "attn_logit_softcapping"),
        output_logit_softcapping=_cap(config, "final_logit_softcapping"),
        query_pre_attn_scalar=None if scalar is None else float(scalar),
    )


def write_gemma(model: ModelConfig, family: str) -> dict[str, Any]:
    """The HF config keys of Gemma 2's layer (shared with Gemma 3) for ``model``."""
    want = ("gelu_tanh", "post_norm", "layernorm_zero_centered_gamma", "input_embeds_norm")
    wrong = [k for k in want if not getattr(model, k)]
    if wrong or model.add_bias_linear or model.add_qkv_bias:
        what = wrong or "biases"
        raise ValueError(f"{family}: its Hugging Face model cannot express this one ({what})")
    scalar = model.query_pre_attn_scalar or model.head_dim
    return {
        "hidden_activation": ACT,
        "hidden_act": ACT,
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "sliding_window": None if model.window_size is None else model.window_size + 1,
        "layer_types": [
            "sliding_attention" if w else "full_attention" for w in model.window_layers()
        ],
        "attn_logit_softcapping": model.attn_logit_softcapping,
        "final_logit_softcapping": model.output_logit_softcapping,
        "attention_bias": False,
    }


def _from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    return read_gemma(config, num_layers, "gemma2")


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    if model.qk_layernorm or model.rotary_base_local not in (None, model.rotary_base):
        raise ValueError("gemma2: Gemma2ForCausalLM has no QK norm and one RoPE (Gemma 3 has)")
    return write_gemma(model, "gemma2")


MAPPING = LLAMA_MAPPING.extend(
    "gemma2",
    {
        "post_attn_norm.weight": "post_attention_layernorm.weight",
        "pre_mlp_layernorm.weight": "pre_feedforward_layernorm.weight",
        "post_mlp_layernorm.weight": "post_feedforward_layernorm.weight",
    },
)

FAMILY = Family(
    name="gemma2",
    hf_architecture="Gemma2ForCausalLM",
    mapping=MAPPING,
    presets=PRESETS,
    tiny=(
        tiny(
            PRESETS[0],
            "tiny-gemma2",
            num_layers=3,
            kv_channels=32,
            window_size=3,
            query_pre_attn_scalar=24.0,
            attn_logit_softcapping=2.0,
            output_logit_softcapping=3.0,
        ),
    ),
    dense_from_hf=_from_hf,
    dense_to_hf=_to_hf,
    head_dim_in_config=True,
    hidden_act=ACT,
)
