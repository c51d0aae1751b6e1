"""Hugging Face ``config.json`` <-> :class:`ModelConfig` for the supported families.

The converter and ``anyspeed pretrain --load <HF dir>`` read an HF config through here; a config
Megatron's GPTModel cannot express is a one-line ValueError naming the field.
"""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families import FAMILIES

HF_ARCHITECTURES = {name: f.hf_architecture for name, f in FAMILIES.items()}
# Megatron's RotaryEmbedding applies LLaMA-3 scaling with only the factor configurable.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}  # fmt: skip


def hf_family(config: dict[str, Any]) -> str:
    """The family (HF ``model_type``) of an HF ``config.json``; ValueError lists the supported."""
    archs = config.get("architectures") or []
    by_arch = {arch: fam for fam, arch in HF_ARCHITECTURES.items()}
    family = by_arch.get(archs[0]) if archs else config.get("model_type")
    if family not in HF_ARCHITECTURES or (archs and len(set(archs)) > 1):
        got = ", ".join(archs) or f"model_type {config.get('model_type')!r}"
        raise ValueError(f"unsupported architecture {got}; supported: "
                         f"{', '.join(sorted(HF_ARCHITECTURES.values()))}")  # fmt: skip
    return family


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope base, llama3 scaling or None) from either ``rope_scaling`` + ``rope_theta``
    (transformers 4) or ``rope_parameters`` (transformers 5)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or params)
    base = float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return base, None
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported (only llama3)")
    for key, want in _MEGATRON_LLAMA3_ROPE.items():
        if float(scaling.get(key, want)) != want:
            raise ValueError(f"llama3 rope scaling {key}={scaling[key]} is not supported "
                             f"(Megatron fixes it to {want})")  # fmt: skip
    keep = ("rope_type", "factor", *_MEGATRON_LLAMA3_ROPE)
    return base, {k: scaling[k] for k in keep if k in scaling}


def preset_from_hf(config: dict[str, Any], name: str | None = None) -> ModelConfig:
    """The preset an HF ``config.json`` (as a dict) describes; ValueError (one line) when
    Megatron's GPTModel cannot express it."""
    family = hf_family(config)
    traits = FAMILIES[family]
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if not traits.qkv_bias and config.get("attention_bias"):  # it adds an o_proj bias too
        raise ValueError("attention_bias=true is not supported")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = config.get("head_dim")
    explicit = head_dim and (traits.qk_norm or int(head_dim) != hidden // heads)
    base, scaling = _hf_rope(config)
    return ModelConfig(
        name=name or f"hf-{family}",
        family=family,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        rotary_base=base,
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        kv_channels=int(head_dim) if explicit else None,
        add_qkv_bias=traits.qkv_bias,
        qk_layernorm=traits.qk_norm,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
    )


def hf_config(model: ModelConfig) -> dict[str, Any]:
    """Fields of the family's Hugging Face ``config.json`` for ``model``."""
    traits = FAMILIES[model.family]
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
        "hidden_act": "silu",
    }
    if model.kv_channels or traits.head_dim_in_config:
        cfg["head_dim"] = model.head_dim
    if traits.attention_bias_key:
        cfg["attention_bias"] = model.add_qkv_bias
    if model.rope_scaling:
        cfg["rope_scaling"] = dict(model.rope_scaling)
    return cfg
