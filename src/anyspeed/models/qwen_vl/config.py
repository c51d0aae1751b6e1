"""A Qwen2-VL / Qwen2.5-VL vision tower's shape, read from a transformers ``vision_config``
(no Megatron import: conversion and the command line read it before any model is built)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class TowerConfig:
    """A Qwen-VL vision tower's shape (``kind``: ``qwen2_vl`` or ``qwen2_5_vl``)."""

    kind: str
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 0  # pixels (Qwen2.5-VL); 0: every layer attends per frame
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    norm_epsilon: float = 1e-6

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def windowed(self) -> bool:
        return self.kind == "qwen2_5_vl" and self.window_size > 0


def tower_from_hf(vc: dict[str, Any]) -> TowerConfig:
    """The tower a transformers ``vision_config`` (as a dict) describes."""
    kind = "qwen2_5_vl" if vc.get("model_type", "").startswith("qwen2_5_vl") else "qwen2_vl"
    rope = (vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    common = dict(
        patch_size=int(vc["patch_size"]),
        temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
        in_channels=int(vc.get("in_channels", 3)),
        spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
        num_layers=int(vc["depth"]),
        num_heads=int(vc["num_heads"]),
        rope_theta=float(rope),
    )
    if kind == "qwen2_vl":
        width = int(vc["embed_dim"])
        return TowerConfig(
            kind,
            width,
            ffn_hidden_size=int(width * vc.get("mlp_ratio", 4)),
            out_hidden_size=int(vc["hidden_size"]),
            **common,
        )
    return TowerConfig(
        kind,
        int(vc["hidden_size"]),
        ffn_hidden_size=int(vc["intermediate_size"]),
        out_hidden_size=int(vc["out_hidden_size"]),
        window_size=int(vc.get("window_size", 0)),
        fullatt_block_indexes=tuple(vc.get("fullatt_block_indexes", ())),
        **common,
    )
