"""Hybrid context parallelism: Ulysses inside groups of U ranks, ring attention across groups.

MindSpeed's ``hybrid_cp_algo`` (``--ulysses-degree-in-cp U``), Megatron's ``a2a+p2p``. It runs on
Megatron's own load-balanced sequence split and hierarchical CP groups, so the data path and
the gradient reduction are Megatron's.
"""

from __future__ import annotations

import torch

from anyspeed.features.context_parallel.ring import ring_attention
from anyspeed.features.context_parallel.ulysses import ulysses_around


def hybrid_attention(q, k, v, scale: float, ulysses_group, ring_group) -> torch.Tensor:
    """Causal attention of hybrid shards q [b,h,s_local,d], k/v [b,hkv,s_local,d].

    Shards are Megatron's load-balanced split over the whole context-parallel group (rank r of
    CP = U x R holds chunks r and 2CP-1-r), with Ulysses groups of U consecutive ranks and ring
    groups of stride U (Megatron's hierarchical CP groups). The Ulysses all-to-all of a group
    gathers chunks that, put in order, form exactly the ring's load-balanced pair of "big"
    chunks (g and 2R-1-g, U chunks each), so ring attention runs across groups unchanged.
    """
    return ulysses_around(
        q,
        k,
        v,
        ulysses_group,
        lambda qh, kh, vh: ring_attention(qh, kh, vh, scale, ring_group),
        load_balanced=True,
    )
