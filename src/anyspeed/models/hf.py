"""Hugging Face ``config.json`` <-> :class:`ModelConfig` for the supported families.

The converter and ``anyspeed pretrain --load <HF dir>`` read an HF config through here; a config
Megatron's GPTModel cannot express is a one-line ValueError naming the field.
"""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families import FAMILIES
from anyspeed.models.hf_rope import DEFAULT_MAX_POSITIONS, hf_rope_parameters

HF_ARCHITECTURES = {name: f.hf_architecture for name, f in FAMILIES.items()}
# Megatron's RotaryEmbedding applies LLaMA-3 scaling with only the factor configurable.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


_REQUIRED = object()


def _number(config: dict[str, Any], key: str, kind: type, default: Any = _REQUIRED) -> Any:
    """``config[key]`` as ``kind`` (int: a whole number >= 1; float: a number); a missing or
    wrong-typed field is a ValueError naming it, not a KeyError or TypeError."""
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"config.json has no {key} (a Hugging Face model config needs it)")
        return default
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        want = "a whole number >= 1" if kind is int else "a number"
        raise ValueError(f"config.json {key} is {value!r:.40}, not {want}")
    return kind(value)


VISION_LANGUAGE = ("llava", "qwen2_vl", "qwen2_5_vl")  # model types the vlm stage takes


def hf_family(config: dict[str, Any]) -> str:
    """The family (HF ``model_type``) of an HF ``config.json``; ValueError lists the supported."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json architectures is {archs!r:.40}, not a list of names")
    by_arch = {arch: fam for fam, arch in HF_ARCHITECTURES.items()}
    # a sequence-classification model (a reward model) is its causal LM's family with a head
    causal = [a.replace("ForSequenceClassification", "ForCausalLM") for a in archs]
    family = by_arch.get(causal[0]) if archs else config.get("model_type")
    if not isinstance(family, str) or family not in HF_ARCHITECTURES or len(set(causal)) > 1:
        got = ", ".join(archs) or f"model_type {config.get('model_type')!r:.40}"
        if config.get("model_type") == "gemma3":
            raise ValueError(
                f"{got} is Gemma 3's vision-language model: anyspeed takes its text model "
                "(Gemma3ForCausalLM); save that with transformers first"
            )
        if config.get("model_type") in VISION_LANGUAGE:
            raise ValueError(
                f"{got} is a vision-language model: train it with `anyspeed posttrain --stage "
                "vlm`, convert it with `anyspeed convert`, ask it with `anyspeed generate "
                "--image` (RL with images is not supported yet)"
            )
        raise ValueError(
            f"unsupported architecture {got}; supported: "
            f"{', '.join(sorted(HF_ARCHITECTURES.values()))}"
        )
    return family


def _llama3_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """The llama3 scaling of ``rope`` (:func:`hf_rope_parameters`), None for plain RoPE;
    ValueError for another kind or a llama3 parameter Megatron's RotaryEmbedding fixes."""
    kind = rope["rope_type"]
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported (only llama3)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:  # transformers' llama3 reads it
        raise ValueError("llama3 rope scaling of part of each head is not supported")
    for key, want in _MEGATRON_LLAMA3_ROPE.items():
        if _number(rope, key, float, want) != want:
            raise ValueError(
                f"llama3 rope scaling {key}={rope[key]} is not supported "
                f"(Megatron fixes it to {want})"
            )
    keep = ("rope_type", "factor", *_MEGATRON_LLAMA3_ROPE)
    return {k: rope[k] for k in keep if k in rope}


def preset_from_hf(config: dict[str, Any], name: str | None = None) -> ModelConfig:
    """The preset an HF ``config.json`` (as a dict) describes; ValueError (one line) when
    Megatron's GPTModel cannot express it."""
    family = hf_family(config)
    traits = FAMILIES[family]
    act = traits.hidden_act
    if config.get("hidden_act", act) != act:
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only {act})")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if not traits.qkv_bias and config.get("attention_bias"):  # it adds an o_proj bias too
        raise ValueError("attention_bias=true is not supported")
    hidden, heads = _number(config, "hidden_size", int), _number(config, "num_attention_heads", int)
    head_dim = _number(config, "head_dim", int, None)
    explicit = head_dim and (traits.qk_norm or head_dim != hidden // heads)
    rope = hf_rope_parameters(config, family, traits.rope_layer_type)  # what transformers reads
    base = _number(rope, "rope_theta", float)
    # the family's hook reads its own rope (YaRN); the rest have plain or llama3 RoPE
    scaling = None if traits.mla or traits.own_rope else _llama3_scaling(rope)
    layers = _number(config, "num_hidden_layers", int)
    own = traits.moe_from_hf or traits.dense_from_hf
    moe = own(config, layers) if own else {}
    fields = dict(
        kv_channels=head_dim if explicit else None,
        num_query_groups=_number(config, "num_key_value_heads", int, heads),
        qk_layernorm=traits.qk_norm,
        add_qkv_bias=traits.qkv_bias,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    fields.update({k: moe.pop(k) for k in list(fields) if k in moe})  # the family's own reading
    model = ModelConfig(
        name=name or f"hf-{family}",
        family=family,
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=_number(config, "intermediate_size", int),
        num_attention_heads=heads,
        vocab_size=_number(config, "vocab_size", int),
        max_position_embeddings=_number(
            config, "max_position_embeddings", int, DEFAULT_MAX_POSITIONS
        ),
        rotary_base=base,
        norm_epsilon=_number(config, "rms_norm_eps", float, 1e-6),
        **fields,
        rope_scaling=scaling,
        **moe,
    )
    model.check()
    return model


def hf_config(model: ModelConfig) -> dict[str, Any]:
    """Fields of the family's Hugging Face ``config.json`` for ``model``."""
    traits = FAMILIES[model.family]
    if any(model.linear_attention_layers()) and not traits.mapping.linear:
        raise ValueError(
            f"{model.family}: its Hugging Face model has no gated DeltaNet layers "
            "(--experimental-attention-variant; Qwen3-Next's has)"
        )
    cfg: dict[str, Any] = {
        "model_type": model.family,
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rope_theta": model.rotary_base,
        "rms_norm_eps": model.norm_epsilon,
        "tie_word_embeddings": model.tie_embeddings,
        "hidden_act": traits.hidden_act,
    }
    if model.kv_channels or traits.head_dim_in_config:
        cfg["head_dim"] = model.head_dim
    if traits.attention_bias_key:
        cfg["attention_bias"] = model.add_qkv_bias
    if model.rope_scaling:  # all of llama3's keys: transformers needs them (and Megatron's)
        cfg["rope_scaling"] = {"rope_type": "llama3", **_MEGATRON_LLAMA3_ROPE, **model.rope_scaling}
    if traits.dense_to_hf:
        if model.is_moe:
            raise ValueError(f"{model.family}: its Hugging Face model has no experts")
        cfg.update(traits.dense_to_hf(model))
    elif model.is_moe:
        if not traits.moe_to_hf:
            raise ValueError(f"{model.family}: its Hugging Face model has no experts")
        cfg.update(traits.moe_to_hf(model))
    elif traits.moe_to_hf:
        raise ValueError(f"{model.family}: its Hugging Face model needs --num-experts")
    return cfg
