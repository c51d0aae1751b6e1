"""The RoPE settings of a Hugging Face ``config.json``, read as transformers reads them.

transformers (``PreTrainedConfig`` -> ``convert_rope_params_to_dict`` and
``standardize_rope_params``) takes a non-empty legacy ``rope_scaling`` *instead of*
``rope_parameters`` -- the two are never merged -- then fills in what the dict leaves out: the
top-level ``rope_theta`` (else the class default), ``partial_rotary_factor`` (the dict's own
value wins), ``rope_type`` from the legacy ``type`` (else ``default``), and for the scaled kinds
``original_max_position_embeddings`` from the top-level key (else ``max_position_embeddings``).
Every family reads its RoPE through :func:`hf_rope_parameters`, so anyspeed converts the model
transformers builds.
"""

from __future__ import annotations

import copy
from typing import Any

# preset_from_hf's max_position_embeddings when config.json has none.
DEFAULT_MAX_POSITIONS = 4096
# transformers' config classes whose default rope_theta is not 10000 (``default_theta``).
_DEFAULT_THETA: dict[Any, float] = {
    "gpt_oss": 150000.0,
    "mixtral": 1000000.0,
    "gemma3_text": 1000000.0,
    ("gemma3_text", "sliding_attention"): 10000.0,
}
# ... and the top-level key that sets a layer type's (Gemma 3's legacy rope_local_base_freq).
_THETA_KEY = {("gemma3_text", "sliding_attention"): "rope_local_base_freq"}
# The one layer type a legacy rope_scaling applies to, where each has its own RoPE.
_LEGACY_LAYER_TYPE = {"gemma3_text": "full_attention"}
# ... and those that default partial_rotary_factor (Qwen3NextConfig: 0.25, Glm4MoeConfig: 0.5).
_DEFAULT_PARTIAL = {"qwen3_next": 0.25, "glm4_moe": 0.5}
# RoPE kinds whose parameters include the pretraining length.
_SCALED = ("llama3", "yarn", "longrope")
# ... which a top-level original_max_position_embeddings overrides (transformers: the config's
# attribute wins; Phi3Config's defaults to 4096).
_DEFAULT_ORIGINAL = {"phi3": 4096}


def _flat(rope: dict[str, Any], config: dict[str, Any], layer_type: str | None) -> dict[str, Any]:
    """``rope`` itself, or its one dict when it is nested by layer type (as transformers
    nests it: keys naming the config's ``layer_types``); ValueError when those differ, unless
    ``layer_type`` picks one (Gemma 3: its own RoPE per kind of layer)."""
    types = config.get("layer_types")
    nested = [k for k in rope if isinstance(types, list) and k in types]
    if not nested:
        return rope
    if layer_type is not None:
        picked = rope.get(layer_type)
        if not isinstance(picked, dict):
            raise ValueError(f"config.json rope_parameters has no object for {layer_type}")
        return picked
    kinds = [rope[k] for k in nested if rope[k] is not None]
    if not kinds or any(not isinstance(k, dict) or k != kinds[0] for k in kinds):
        raise ValueError(
            "config.json rope_parameters differ per layer type (one RoPE for every layer "
            "is supported)"
        )
    return kinds[0]


def hf_rope_parameters(
    config: dict[str, Any], family: str, layer_type: str | None = None
) -> dict[str, Any]:
    """The RoPE parameters transformers builds ``family``'s model with from ``config`` (an
    HF ``config.json``): ``rope_type`` (``default`` for plain RoPE), ``rope_theta`` and the
    kind's own keys (of ``layer_type``'s layers where they differ by kind); ValueError (one
    line) when the fields are not objects or numbers."""
    legacy = config.get("rope_scaling")
    if legacy and layer_type not in (None, _LEGACY_LAYER_TYPE.get(family, layer_type)):
        legacy = None  # Gemma 3's legacy rope_scaling is its full-attention layers' only
    rope = legacy or config.get("rope_parameters") or {}
    if not isinstance(rope, dict) or not isinstance(config.get("rope_parameters") or {}, dict):
        raise ValueError("config.json rope_parameters / rope_scaling is not an object")
    rope = copy.deepcopy(_flat(rope, config, layer_type))
    theta = config.get(_THETA_KEY.get((family, layer_type), "rope_theta"))
    default = _DEFAULT_THETA.get((family, layer_type), _DEFAULT_THETA.get(family, 10000.0))
    rope.setdefault("rope_theta", default if theta is None else theta)
    partial = config.get("partial_rotary_factor", _DEFAULT_PARTIAL.get(family))
    if partial is not None:
        rope.setdefault("partial_rotary_factor", partial)
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in _SCALED or (family == "phi3" and rope["rope_type"] in ("su", "yarn")):
        positions = config.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS
        rope.setdefault("original_max_position_embeddings", positions)
        top = config.get("original_max_position_embeddings", _DEFAULT_ORIGINAL.get(family))
        if top is not None:
            rope["original_max_position_embeddings"] = top
    for key in ("rope_theta", "partial_rotary_factor", "factor"):
        value = rope.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"config.json rope {key} is {value!r:.40}, not a number")
    return rope


def yarn_mscales(rope: dict[str, Any], family: str) -> tuple[float, float]:
    """(mscale, mscale_all_dim) for Megatron that scale like transformers' YaRN: it uses their
    ratio only when both are set, else YaRN's default (Megatron's with mscale 1, all-dim 0);
    ValueError for what Megatron cannot express (attention_factor, a partial rotation, an
    all-dim mscale without mscale)."""
    if rope.get("attention_factor") is not None:
        raise ValueError(f"{family}: YaRN attention_factor is not supported")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{family}: YaRN on part of each head is not supported")
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if all_dim and not mscale:
        raise ValueError(f"{family}: YaRN mscale_all_dim without mscale is not supported")
    return (float(mscale), float(all_dim)) if mscale and all_dim else (1.0, 0.0)


def yarn_factor(rope: dict[str, Any], max_positions: int) -> float:
    """YaRN's scaling factor; transformers' ratio of the lengths when the config has none."""
    factor = rope.get("factor")
    if factor is None:
        return max_positions / float(rope["original_max_position_embeddings"])
    return float(factor)


def gpt_yarn(rope: dict[str, Any], family: str, max_positions: int) -> dict[str, Any]:
    """The ModelConfig fields of YaRN on a plain-attention model (``--position-embedding-type
    yarn``) from ``rope`` (:func:`hf_rope_parameters`)."""
    mscale, all_dim = yarn_mscales(rope, family)
    return dict(
        position_embedding_type="yarn",
        rotary_scaling_factor=yarn_factor(rope, max_positions),
        mscale=mscale,
        mscale_all_dim=all_dim,
        yarn_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
        yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
        yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
    )


def yarn_mscales_to_hf(model: Any) -> dict[str, float]:
    """The YaRN mscale keys of an HF config for ``model`` (none at YaRN's default)."""
    if model.mscale_all_dim:
        return {"mscale": model.mscale, "mscale_all_dim": model.mscale_all_dim}
    return {}
