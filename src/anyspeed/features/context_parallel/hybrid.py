"""Hybrid context parallelism: Ulysses inside groups of U ranks, ring attention across groups.

MindSpeed's ``hybrid_cp_algo`` (``--ulysses-degree-in-cp U``), Megatron's ``a2a+p2p``. It runs on
Megatron's own load-balanced sequence split and hierarchical CP groups, so the data path and
the gradient reduction are Megatron's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from anyspeed.features.context_parallel.ring import ring_attention
from anyspeed.features.context_parallel.ulysses import ulysses_around


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
    return ulysses_around(
        q, k, v, ulysses_group, lambda qh, kh, vh: ring_attention(qh, kh, vh, scale, ring_group),
        load_balanced=True,
    )  # fmt: skip
