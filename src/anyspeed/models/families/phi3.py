"""Phi-3, Phi-3.5 and Phi-4 (Microsoft): the LLaMA layer with queries, keys and values in one
HF projection (``qkv_proj``) and the MLP's gate and up in one (``gate_up_proj``, already
Megatron's [gate; up]); LongRoPE for 128k contexts (Phi-3.5-mini, Phi-4-mini), RoPE on part of
each head (Phi-4-mini), a sliding window of 2,047 keys (Phi-3's 4k models)."""

from __future__ import annotations

from typing import Any

from anyspeed.argv import factor_list
from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import LLAMA_MAPPING, Family, Fused, tiny
from anyspeed.models.families.moe_hf import int_of
from anyspeed.models.hf_rope import hf_rope_parameters
from anyspeed.models.longrope import attention_factor

# Phi-3.5-mini's LongRoPE factors (its config.json; MindSpeed-LLM's script passes the same).
PHI35_SHORT = factor_list(
    "1.0,1.0199999809265137,1.0299999713897705,1.0299999713897705,1.0499999523162842,"
    "1.0499999523162842,1.0499999523162842,1.0499999523162842,1.0499999523162842,"
    "1.0699999332427979,1.0999999046325684,1.1099998950958252,1.1599998474121094,"
    "1.1599998474121094,1.1699998378753662,1.2899998426437378,1.339999794960022,"
    "1.679999828338623,1.7899998426437378,1.8199998140335083,1.8499997854232788,"
    "1.8799997568130493,1.9099997282028198,1.9399996995925903,1.9899996519088745,"
    "2.0199997425079346,2.0199997425079346,2.0199997425079346,2.0199997425079346,"
    "2.0199997425079346,2.0199997425079346,2.0299997329711914,2.0299997329711914,"
    "2.0299997329711914,2.0299997329711914,2.0299997329711914,2.0299997329711914,"
    "2.0299997329711914,2.0299997329711914,2.0299997329711914,2.0799996852874756,"
    "2.0899996757507324,2.189999580383301,2.2199995517730713,2.5899994373321533,"
    "2.729999542236328,2.749999523162842,2.8399994373321533"
)
PHI35_LONG = factor_list(
    "1.0800000429153442,1.1100000143051147,1.1399999856948853,1.340000033378601,"
    "1.5899999141693115,1.600000023841858,1.6200000047683716,2.620000123977661,"
    "3.2300000190734863,3.2300000190734863,4.789999961853027,7.400000095367432,"
    "7.700000286102295,9.09000015258789,12.199999809265137,17.670000076293945,"
    "24.46000099182129,28.57000160217285,30.420001983642578,30.840002059936523,"
    "32.590003967285156,32.93000411987305,42.320003509521484,44.96000289916992,"
    "50.340003967285156,50.45000457763672,57.55000305175781,57.93000411987305,"
    "58.21000289916992,60.1400032043457,62.61000442504883,62.62000274658203,"
    "62.71000289916992,63.1400032043457,63.1400032043457,63.77000427246094,"
    "63.93000411987305,63.96000289916992,63.970001220703125,64.02999877929688,"
    "64.06999969482422,64.08000183105469,64.12000274658203,64.41000366210938,"
    "64.4800033569336,64.51000213623047,64.52999877929688,64.83999633789062"
)
_LONGROPE_NAMES = ("longrope", "su", "yarn")  # transformers reads Phi-3's older names as LongRoPE


def _phi(name, layers, h, ffn, heads, groups, vocab, maxpos, base, **traits) -> ModelConfig:
    shape = (layers, h, ffn, heads, groups, vocab, maxpos, base)
    return ModelConfig(name, "phi3", *shape, 1e-5, **traits)


_LONG_35 = dict(
    longrope_short_factor=PHI35_SHORT,
    longrope_long_factor=PHI35_LONG,
    longrope_original_max_position_embeddings=4096,
)
PRESETS = (
    _phi("phi3-mini-4k", 32, 3072, 8192, 32, 32, 32064, 4096, 10000.0, window_size=2046),
    _phi("phi3-medium-4k", 40, 5120, 17920, 40, 10, 32064, 4096, 10000.0, window_size=2046),
    _phi("phi3.5-mini", 32, 3072, 8192, 32, 32, 32064, 131072, 10000.0, **_LONG_35),
    _phi("phi4", 40, 5120, 17920, 40, 10, 100352, 16384, 250000.0),
)


def _factors(rope: dict[str, Any], key: str) -> tuple[float, ...]:
    value = rope.get(key)
    if not isinstance(value, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"config.json rope {key} is {value!r:.40}, not a list of numbers")
    return tuple(float(v) for v in value)


def _from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """LongRoPE, the rotary fraction and the window of a Phi-3 ``config.json``."""
    rope = hf_rope_parameters(config, "phi3")
    kind = rope["rope_type"]
    if kind not in ("default", *_LONGROPE_NAMES):
        raise ValueError(f"phi3: rope scaling {kind!r} is not supported (only longrope)")
    positions = config.get("max_position_embeddings") or 4096
    window = config.get("sliding_window")
    out: dict[str, Any] = dict(
        rotary_percent=float(rope.get("partial_rotary_factor", 1.0)),
        # a window as long as the context never bites (Phi-3.5's 262,144)
        window_size=None
        if window is None or window >= positions
        else int_of(config, "sliding_window") - 1,
    )
    if kind in _LONGROPE_NAMES:
        out.update(
            longrope_short_factor=_factors(rope, "short_factor"),
            longrope_long_factor=_factors(rope, "long_factor"),
            longrope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
        given = rope.get("attention_factor")
        implied = attention_factor(ModelConfig(max_position_embeddings=positions, **out))
        if given is not None and abs(float(given) - implied) > 1e-6 * implied:
            raise ValueError(
                f"phi3: LongRoPE attention_factor {given} is not supported (only the one the "
                f"lengths imply, {implied:.6g})"
            )
    return out


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    if model.add_bias_linear or model.add_qkv_bias or model.qk_layernorm:
        raise ValueError("phi3: Phi3ForCausalLM has no biases or QK norm")
    out: dict[str, Any] = {
        "partial_rotary_factor": model.rotary_percent,
        "sliding_window": None if model.window_size is None else model.window_size + 1,
        "original_max_position_embeddings": model.longrope_original_max_position_embeddings
        or model.max_position_embeddings,
        "rope_scaling": None,
    }
    if model.vocab_size <= 32000:  # Phi3Config's default token ids (32000) would not exist
        out.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if model.longrope:
        out["rope_scaling"] = {
            "type": "longrope",
            "rope_type": "longrope",
            "short_factor": list(model.longrope_short_factor or ()),
            "long_factor": list(model.longrope_long_factor or ()),
        }
    return out


MAPPING = LLAMA_MAPPING.extend(
    "phi3",
    {
        "self_attention.linear_qkv.weight": Fused("qkv_packed", ("self_attn.qkv_proj.weight",)),
        "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    },
)

FAMILY = Family(
    name="phi3",
    hf_architecture="Phi3ForCausalLM",
    mapping=MAPPING,
    presets=PRESETS,
    tiny=(
        tiny(
            PRESETS[2],
            "tiny-phi3",
            num_layers=3,
            max_position_embeddings=64,
            rotary_percent=0.75,  # 12 of 16 channels rotate (Phi-4-mini's fraction)
            window_size=9,
            longrope_short_factor=(1.0, 1.1, 1.25, 1.5, 2.0, 3.0),
            longrope_long_factor=(1.5, 2.0, 4.0, 8.0, 16.0, 32.0),
            longrope_original_max_position_embeddings=16,
        ),
    ),
    own_rope=True,
    dense_from_hf=_from_hf,
    dense_to_hf=_to_hf,
)
