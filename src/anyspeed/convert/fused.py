"""Fused Megatron tensors and their Hugging Face parts, as row views.

A Megatron tensor the converter builds from several HF tensors (QKV, SwiGLU's [gate; up],
Qwen3-Next's gated queries and DeltaNet input projection) is described by the rows of each part
in it; :class:`Stacked` keeps such a tensor as views of the parts until a writer needs bytes.
"""

from __future__ import annotations

import torch

from anyspeed.distributed.resharding import Stacked, take_rows
from anyspeed.models.config import ModelConfig
from anyspeed.models.families import Fused


# ------------------------------------------------------------------------------------ fusions
def _qkv_dims(preset: ModelConfig) -> tuple[int, int, int]:
    per_group = preset.num_attention_heads // preset.num_query_groups
    return preset.num_query_groups, per_group, preset.head_dim


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, preset: ModelConfig):
    """[q; k; v] -> Megatron's layout: per query group, its query heads then its K then its V."""
    ng, per, d = _qkv_dims(preset)
    rest = q.shape[1:]
    parts = [q.reshape(ng, per * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)]
    return torch.cat(parts, dim=1).reshape(ng * (per + 2) * d, *rest)


def fuse(f: Fused, tensors: list[torch.Tensor], preset: ModelConfig) -> torch.Tensor:
    if f.kind in PERMUTED:
        return fuse_lazy(f, tensors, preset).materialize()
    if f.kind != "qkv":
        return torch.cat(tensors, dim=0)
    q, k, v = tensors
    return fuse_qkv(q, k, v, preset)


def part_rows(f: Fused, rows: int, preset: ModelConfig) -> list[list[tuple[int, int]]]:
    """The row ranges of a fused tensor that make up each of its parts, in order."""
    if f.kind in PERMUTED:
        return PERMUTED[f.kind](preset)
    if f.kind != "qkv":
        return [[(0, rows // 2)], [(rows // 2, rows)]]
    return _qkv_rows(preset)


def _qkv_rows(preset: ModelConfig) -> list[list[tuple[int, int]]]:
    """The query, key and value rows of Megatron's ``linear_qkv``, group by group."""
    ng, per, d = _qkv_dims(preset)
    step = (per + 2) * d
    bounds = [(0, per * d), (per * d, (per + 1) * d), ((per + 1) * d, step)]
    return [[(g * step + a, g * step + b) for g in range(ng)] for a, b in bounds]


def _packed_qkv_rows(preset: ModelConfig) -> list[list[tuple[int, int]]]:
    """Phi-3's ``qkv_proj``: one HF tensor of all queries, then all keys, then all values."""
    q, k, v = _qkv_rows(preset)
    return [q + k + v]


def _gated_qkv_rows(preset: ModelConfig) -> list[list[tuple[int, int]]]:
    """Queries with output gates: HF's ``q_proj`` holds each head's query then its gate;
    Megatron's ``linear_qkv`` per query group its queries, their gates, K, V."""
    ng, per, d = _qkv_dims(preset)
    step = (2 * per + 2) * d
    q = [
        (g * step + o + j * d, g * step + o + (j + 1) * d)
        for g in range(ng)
        for j in range(per)
        for o in (0, per * d)
    ]
    k = [(g * step + 2 * per * d, g * step + (2 * per + 1) * d) for g in range(ng)]
    v = [(g * step + (2 * per + 1) * d, (g + 1) * step) for g in range(ng)]
    return [q, k, v]


def _delta_in_rows(preset: ModelConfig) -> list[list[tuple[int, int]]]:
    """The DeltaNet's input projection: HF groups [q, k, v, z] and [beta, alpha] per key head;
    Megatron's ``in_proj`` holds all q, then all k, v, z, beta, alpha."""
    hk, dk = preset.linear_num_key_heads, preset.linear_key_head_dim
    hv, dv = preset.linear_num_value_heads, preset.linear_value_head_dim
    r, qk, v = hv // hk, hk * dk, hv * dv
    starts = (0, qk, 2 * qk, 2 * qk + v)  # q, k, v, z
    sizes = (dk, dk, r * dv, r * dv)
    qkvz = [
        (s + h * n, s + (h + 1) * n) for h in range(hk) for s, n in zip(starts, sizes, strict=True)
    ]
    b = 2 * qk + 2 * v
    ba = [(s + h * r, s + (h + 1) * r) for h in range(hk) for s in (b, b + hv)]
    return [qkvz, ba]


def _delta_in_flat_rows(preset: ModelConfig) -> list[list[tuple[int, int]]]:
    """Qwen3.5's DeltaNet input projections: HF's ``in_proj_qkv`` (all q, k, v), ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a`` one after another, as Megatron's ``in_proj`` holds them."""
    hv = preset.linear_num_value_heads
    qk = preset.linear_num_key_heads * preset.linear_key_head_dim
    v = hv * preset.linear_value_head_dim
    ends = (2 * qk + v, 2 * qk + 2 * v, 2 * qk + 2 * v + hv, 2 * qk + 2 * v + 2 * hv)
    return [[(lo, hi)] for lo, hi in zip((0, *ends[:-1]), ends, strict=True)]


# Fusions whose parts interleave in Megatron's tensor: each part's rows, range by range.
PERMUTED = {
    "qkv_packed": _packed_qkv_rows,
    "qgkv": _gated_qkv_rows,
    "delta_in": _delta_in_rows,
    "delta_in_flat": _delta_in_flat_rows,
}


def split_fused(f: Fused, t: torch.Tensor | Stacked, preset: ModelConfig) -> list:
    """The parts of fused ``t``, as row views (a :class:`Stacked` of them for a part made of
    several query groups' rows): the writers take them without a copy."""
    return [take_rows(t, ranges) for ranges in part_rows(f, t.shape[0], preset)]


def fuse_lazy(f: Fused, tensors: list[torch.Tensor], preset: ModelConfig) -> Stacked:
    """:func:`fuse` as row views: per query group its query rows, then its K and V rows."""
    if f.kind in PERMUTED:  # every part's row ranges, put in Megatron's order
        pieces = []
        for t, ranges in zip(tensors, PERMUTED[f.kind](preset), strict=True):
            at = 0
            for lo, hi in ranges:
                pieces.append((lo, t[at : at + hi - lo]))
                at += hi - lo
        return Stacked([p for _, p in sorted(pieces, key=lambda x: x[0])])
    if f.kind != "qkv":
        return Stacked(tensors)
    ng, per, d = _qkv_dims(preset)
    q, k, v = tensors
    rows = [(q, per * d), (k, d), (v, d)]
    return Stacked([t[g * n : (g + 1) * n] for g in range(ng) for t, n in rows])


def delta_net_shapes(preset: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full shapes of a gated DeltaNet's tensors (by name suffix)."""
    hv, dv = preset.linear_num_value_heads, preset.linear_value_head_dim
    qk, v = preset.linear_num_key_heads * preset.linear_key_head_dim, hv * dv
    return {
        "in_proj.weight": (2 * qk + 2 * v + 2 * hv, preset.hidden_size),
        "conv1d.weight": (2 * qk + v, 1, preset.linear_conv_kernel_dim),
        "A_log": (hv,),
        "dt_bias": (hv,),
        "out_norm.weight": (dv,),
        "out_proj.weight": (preset.hidden_size, v),
    }
