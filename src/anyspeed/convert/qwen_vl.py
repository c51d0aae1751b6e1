"""Qwen2-VL / Qwen2.5-VL vision-tower tensors between transformers and
:class:`anyspeed.models.qwen_vl.tower.QwenVisionTower`, both ways and bit-exact.

HF names are relative to the tower (``patch_embed.proj.weight``, ``blocks.0.attn.qkv.weight``,
``merger.mlp.0.bias``); callers add ``model.visual.`` (transformers 5) or ``visual.`` (older
checkpoints). HF's fused ``qkv`` holds all query heads, then all key heads, then all value
heads; Megatron's holds each head's query, key and value together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from anyspeed.convert import engine
from anyspeed.convert.errors import ConvertError
from anyspeed.models.config import ModelConfig
from anyspeed.models.families import mapping_for
from anyspeed.models.hf import preset_from_hf
from anyspeed.models.qwen_vl.config import TowerConfig, tower_from_hf

VISUAL, LANGUAGE = "model.visual.", "model.language_model."
DEFAULT_SECTION = (16, 24, 24)

_BOTH = ("weight", "bias")


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[q; k; v] (each all heads) -> per head [q_h; k_h; v_h]."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _per_kind(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`_per_head`."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _renames(prefix: tuple[str, str], names: dict[str, str], params: tuple[str, ...]) -> list:
    """(HF name, Megatron name) of each of ``params`` of each renamed module under ``prefix``."""
    hf, mg = prefix
    return [(f"{hf}{a}.{p}", f"{mg}{b}.{p}") for a, b in names.items() for p in params]


def _plain_pairs(cfg: TowerConfig) -> list[tuple[str, str]]:
    """(HF name, Megatron name) of every tensor copied as it is."""
    qwen2 = cfg.kind == "qwen2_vl"
    norm = _BOTH if qwen2 else ("weight",)  # Qwen2.5-VL's RMSNorm has no bias
    pairs = _renames(("merger.", ""), {"ln_q": "merger_norm"}, norm)
    pairs += _renames(("merger.", ""), {"mlp.0": "merger_fc1", "mlp.2": "merger_fc2"}, _BOTH)
    linears = {"attn.proj": "self_attention.linear_proj"}
    if qwen2:
        linears.update({"mlp.fc1": "mlp.linear_fc1", "mlp.fc2": "mlp.linear_fc2"})
    else:
        linears["mlp.down_proj"] = "mlp.linear_fc2"
    for i in range(cfg.num_layers):
        layer = (f"blocks.{i}.", f"decoder.layers.{i}.")
        pairs += _renames(layer, {"norm1": "input_layernorm", "norm2": "pre_mlp_layernorm"}, norm)
        pairs += _renames(layer, linears, _BOTH)
    return pairs


def tower_to_megatron(
    cfg: TowerConfig, read: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The tower's Megatron state from HF tensors ``read(name relative to the tower)``."""
    out = {mg: read(hf) for hf, mg in _plain_pairs(cfg)}
    out["patch_embed.weight"] = read("patch_embed.proj.weight").reshape(cfg.hidden_size, -1)
    for i in range(cfg.num_layers):
        hf, mg = f"blocks.{i}.", f"decoder.layers.{i}."
        for p in ("weight", "bias"):
            qkv = read(f"{hf}attn.qkv.{p}")
            out[f"{mg}self_attention.linear_qkv.{p}"] = _per_head(qkv, cfg.num_heads)
            if cfg.kind == "qwen2_5_vl":
                gate, up = read(f"{hf}mlp.gate_proj.{p}"), read(f"{hf}mlp.up_proj.{p}")
                out[f"{mg}mlp.linear_fc1.{p}"] = torch.cat([gate, up])
    return out


def tower_to_hf(cfg: TowerConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors (names relative to the tower) of a Megatron tower state."""
    out = {hf: state[mg] for hf, mg in _plain_pairs(cfg)}
    p = cfg.patch_size
    shape = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, p, p)
    out["patch_embed.proj.weight"] = state["patch_embed.weight"].reshape(shape)
    for i in range(cfg.num_layers):
        hf, mg = f"blocks.{i}.", f"decoder.layers.{i}."
        for q in ("weight", "bias"):
            qkv = state[f"{mg}self_attention.linear_qkv.{q}"]
            out[f"{hf}attn.qkv.{q}"] = _per_kind(qkv, cfg.num_heads)
            if cfg.kind == "qwen2_5_vl":
                gate, up = state[f"{mg}mlp.linear_fc1.{q}"].chunk(2)
                out[f"{hf}mlp.gate_proj.{q}"], out[f"{hf}mlp.up_proj.{q}"] = gate, up
    return out


def language_preset(config: dict[str, Any]) -> ModelConfig:
    """The language model of a Qwen2-VL / Qwen2.5-VL ``config.json`` as a Qwen2 preset with
    mRoPE (its ``mrope_section``, rope theta and vocabulary)."""
    text = dict(config.get("text_config") or config)
    rope = text.get("rope_parameters") or {}
    section = rope.get("mrope_section") or (text.get("rope_scaling") or {}).get("mrope_section")
    section = section or DEFAULT_SECTION  # transformers' default when the config has none
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if 2 * sum(section) != head_dim:
        raise ConvertError(
            f"mrope_section {list(section)} covers {2 * sum(section)} of the head's "
            f"{head_dim} channels: it must cover all of them"
        )
    text.update(model_type="qwen2", rope_theta=rope.get("rope_theta", text.get("rope_theta")))
    text.pop("rope_parameters", None)
    preset = preset_from_hf(text)
    return dataclasses.replace(
        preset, position_embedding_type="mrope", mrope_section=tuple(int(x) for x in section)
    )


def model_to_megatron(
    config: dict[str, Any], read: Callable[[str], torch.Tensor], vocab: int | None = None
) -> tuple[TowerConfig, ModelConfig, dict[str, torch.Tensor]]:
    """Tower config, language preset and the whole Megatron state (``vision.*``,
    ``language_model.*``) from HF tensors ``read(transformers-5 name)``; the vocabulary rows
    padded to ``vocab`` (default: the config's)."""
    tower = tower_from_hf(config["vision_config"])
    preset = language_preset(config)
    vision = tower_to_megatron(tower, lambda n: read(VISUAL + n))
    state = {f"vision.{k}": v for k, v in vision.items()}
    m = mapping_for(preset.family)

    def lm_read(name: str) -> torch.Tensor:  # the Qwen2 mapping's model.* is model.language_model.*
        return read(name.replace("model.", LANGUAGE, 1))

    for g in engine.groups(preset):
        part = engine.to_megatron(m, preset, g, lm_read, vocab or preset.vocab_size)
        state.update({f"language_model.{k}": engine.materialize(v) for k, v in part.items()})
    return tower, preset, state


_VISION_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")
_VISION_ROW = ("linear_proj.weight", "linear_fc2.weight")


def shard(name: str, t: torch.Tensor, tp: int, rank: int, gated: bool) -> torch.Tensor:
    """TP rank ``rank``'s part of whole tensor ``name`` of a :class:`QwenVLModel` state; the
    tower's ``linear_fc1`` is ``[gate; up]`` when ``gated`` (Qwen2.5-VL): each rank takes its
    rows of both. The patch embedding and the merger are whole on every rank."""
    if name.startswith("language_model."):
        return engine.materialize(engine.shard_tp(name[len("language_model.") :], t, tp, rank))
    if tp == 1 or not name.startswith("vision.decoder."):
        return t
    if gated and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return torch.cat([half.chunk(tp, dim=0)[rank] for half in t.chunk(2, dim=0)])
    if name.endswith(_VISION_COLUMN):
        return t.chunk(tp, dim=0)[rank]
    if name.endswith(_VISION_ROW):
        return t.chunk(tp, dim=1)[rank]
    return t


def model_to_hf(
    tower: TowerConfig, preset: ModelConfig, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """HF tensors (transformers-5 names) of a whole :class:`QwenVLModel` state."""
    out = {VISUAL + k: v for k, v in tower_to_hf(tower, _under(state, "vision.")).items()}
    m, lm = mapping_for(preset.family), _under(state, "language_model.")
    for g in engine.groups(preset):
        part = engine.to_hf(m, preset, g, lm, preset.vocab_size)
        out.update({_hf_lm(k): engine.materialize(t) for k, t in part.items()})
    return {k: t.contiguous() for k, t in out.items()}


def _under(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _hf_lm(name: str) -> str:
    """A Qwen2 mapping's name (``model.*``, ``lm_head.*``) inside the Qwen-VL model."""
    return LANGUAGE + name[len("model.") :] if name.startswith("model.") else name


def current_name(name: str) -> str:
    """A checkpoint's tensor name in transformers-5 spelling: older checkpoints (and the Hub's)
    keep the tower at ``visual.*`` and the language model at ``model.*``."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith((VISUAL, LANGUAGE)):
        return LANGUAGE + name[len("model.") :]
    return name
