"""Gemma 3's text model (Google, 2025; transformers' ``Gemma3ForCausalLM``): Gemma 2's layer
(sandwich norms as ``1 + w``, the tanh-GELU GLU, scaled and tied embeddings, scores scaled by
``query_pre_attn_scalar``) with RMSNorm on queries and keys, five sliding-window layers to
every full one, no soft-capping, and a RoPE per kind of layer: base 10,000 on the windowed
layers, 1,000,000 on the full ones (there with positions divided by 8, transformers' "linear"
RoPE, from the 4B up). The 4B/12B/27B checkpoints are vision-language models
(``Gemma3ForConditionalGeneration``); these presets are their text models."""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families import gemma2
from anyspeed.models.families.base import Family, tiny
from anyspeed.models.hf_rope import hf_rope_parameters

FULL, SLIDING = "full_attention", "sliding_attention"
_TRAITS = dict(
    gemma2._TRAITS,
    qk_layernorm=True,
    window_attn_skip_freq="6",
    attn_logit_softcapping=None,
    output_logit_softcapping=None,
    rotary_base_local=10000.0,
)


def _gemma3(name, layers, h, ffn, heads, groups, head_dim, scalar, vocab, window, factor):
    traits = dict(
        _TRAITS,
        kv_channels=head_dim,
        query_pre_attn_scalar=float(scalar),
        window_size=window - 1,
        rotary_seq_len_interpolation_factor=factor,
    )
    positions = 32768 if factor is None else 131072
    return ModelConfig(
        name, "gemma3_text", layers, h, ffn, heads, groups, vocab, positions, 1e6, 1e-6, **traits
    )


PRESETS = (
    _gemma3("gemma3-1b", 26, 1152, 6912, 4, 1, 256, 256, 262144, 512, None),
    _gemma3("gemma3-4b", 34, 2560, 10240, 8, 4, 256, 256, 262208, 1024, 8.0),
    _gemma3("gemma3-12b", 48, 3840, 15360, 16, 8, 256, 256, 262208, 1024, 8.0),
    _gemma3("gemma3-27b", 62, 5376, 21504, 32, 16, 128, 168, 262208, 1024, 8.0),
)


def _rope(config: dict[str, Any], layer_type: str) -> dict[str, Any]:
    rope = hf_rope_parameters(config, "gemma3_text", layer_type)
    kind = rope["rope_type"]
    if kind not in ("default", "linear") or (kind == "linear" and layer_type == SLIDING):
        raise ValueError(f"gemma3_text: {layer_type} rope_type {kind!r} is not supported")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("gemma3_text: RoPE on part of each head is not supported")
    return rope


def _from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    pattern = config.get("sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"config.json sliding_window_pattern is {pattern!r:.40}, not a number")
    out = gemma2.read_gemma(config, num_layers, "gemma3_text", pattern)
    full, local = _rope(config, FULL), _rope(config, SLIDING)
    factor = float(full["factor"]) if full["rope_type"] == "linear" else None
    return dict(
        out,
        qk_layernorm=True,
        rotary_base_local=float(local["rope_theta"]),
        rotary_seq_len_interpolation_factor=None if factor == 1.0 else factor,
    )


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    if not model.qk_layernorm:
        raise ValueError("gemma3_text: Gemma3ForCausalLM has RMSNorm on queries and keys")
    cfg = gemma2.write_gemma(model, "gemma3_text")
    factor = model.rotary_seq_len_interpolation_factor
    full = {"rope_type": "default", "rope_theta": model.rotary_base}
    if factor:
        full = {"rope_type": "linear", "factor": factor, "rope_theta": model.rotary_base}
    local = model.rotary_base if model.rotary_base_local is None else model.rotary_base_local
    cfg["rope_parameters"] = {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": local}}
    return cfg


MAPPING = gemma2.MAPPING.extend(
    "gemma3_text",
    {
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    },
)

FAMILY = Family(
    name="gemma3_text",
    hf_architecture="Gemma3ForCausalLM",
    mapping=MAPPING,
    presets=PRESETS,
    tiny=(
        tiny(
            PRESETS[1],
            "tiny-gemma3",
            num_layers=3,
            kv_channels=32,
            window_size=3,
            window_attn_skip_freq="3",
            query_pre_attn_scalar=24.0,
            rotary_base_local=100.0,
            rotary_seq_len_interpolation_factor=4.0,
        ),
    ),
    dense_from_hf=_from_hf,
    dense_to_hf=_to_hf,
    qk_norm=True,
    head_dim_in_config=True,
    hidden_act=gemma2.ACT,
    own_rope=True,
    rope_layer_type=FULL,
)
