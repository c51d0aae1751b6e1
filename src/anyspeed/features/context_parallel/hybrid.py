"""Hybrid context parallelism: Ulysses inside groups of K ranks, ring attention across groups.

The sequence is split load-balanced across the ring (2 x R chunks, see ``ring``), and each
ring shard contiguously across its Ulysses group. The Ulysses all-to-all gives each rank its
ring shard for 1/K of the heads; ring attention runs across the groups; a second all-to-all
restores the sequence shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from anyspeed.features.context_parallel.ring import ring_attention
from anyspeed.features.context_parallel.ulysses import _HeadsToSeq, _SeqToHeads


def hybrid_groups(ulysses_degree: int):
    """(ulysses group, ring group) of this rank; every rank must call this, in the same order.

    Ulysses groups are runs of consecutive ranks; a ring group holds the ranks at the same
    position of every Ulysses group.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ulysses_degree:
        raise ValueError(
            f"context-parallel size {world} is not divisible by --ulysses-degree-in-cp "
            f"{ulysses_degree}"
        )
    mine_u = mine_r = None
    for start in range(0, world, ulysses_degree):
        g = dist.new_group(list(range(start, start + ulysses_degree)))
        if start <= rank < start + ulysses_degree:
            mine_u = g
    for pos in range(ulysses_degree):
        g = dist.new_group(list(range(pos, world, ulysses_degree)))
        if rank % ulysses_degree == pos:
            mine_r = g
    return mine_u, mine_r


def hybrid_attention(q, k, v, scale: float, ulysses_group, ring_group) -> torch.Tensor:
    """Causal attention of hybrid shards q [b,h,s_local,d], k/v [b,hkv,s_local,d]."""
    u = dist.get_world_size(ulysses_group)
    h, hkv = q.shape[1], k.shape[1]
    if h % u:
        raise ValueError(f"attention heads {h} are not divisible by the Ulysses degree {u}")
    if hkv % u:
        k, v = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
    qh, kh, vh = (_SeqToHeads.apply(t, ulysses_group) for t in (q, k, v))
    out = ring_attention(qh, kh, vh, scale, ring_group)
    return _HeadsToSeq.apply(out, ulysses_group)
