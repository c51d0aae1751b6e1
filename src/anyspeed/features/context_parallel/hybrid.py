"""Hybrid context parallelism: Ulysses inside groups of U ranks, ring attention across groups.

MindSpeed's ``hybrid_cp_algo`` (``--ulysses-degree-in-cp U``), Megatron's ``a2a+p2p``. It runs on
Megatron's own load-balanced sequence split and hierarchical CP groups, so the data path and
the gradient reduction are Megatron's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from anyspeed.features.context_parallel.ring import ring_attention
from anyspeed.features.context_parallel.ulysses import _balanced_order, _HeadsToSeq, _SeqToHeads


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
    """Causal attention of hybrid shards q [b,h,s_local,d], k/v [b,hkv,s_local,d].

    Shards are Megatron's load-balanced split over the whole context-parallel group (rank r of
    CP = U x R holds chunks r and 2CP-1-r), with Ulysses groups of U consecutive ranks and ring
    groups of stride U (Megatron's hierarchical CP groups). The Ulysses all-to-all of a group
    gathers chunks that, put in order, form exactly the ring's load-balanced pair of "big"
    chunks (g and 2R-1-g, U chunks each), so ring attention runs across groups unchanged.
    """
    u = dist.get_world_size(ulysses_group)
    h, hkv = q.shape[1], k.shape[1]
    if h % u:
        raise ValueError(f"attention heads {h} are not divisible by the Ulysses degree {u}")
    if hkv % u:  # too few K/V heads to split: replicate them to the query heads
        k, v = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
    qh, kh, vh = (_SeqToHeads.apply(t, ulysses_group) for t in (q, k, v))
    order = _balanced_order(u, qh.shape[2], qh.device)
    qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))
    out = ring_attention(qh, kh, vh, scale, ring_group)
    out = out.index_select(2, torch.argsort(order))
    return _HeadsToSeq.apply(out, ulysses_group)
