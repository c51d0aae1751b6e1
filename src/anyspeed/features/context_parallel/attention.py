"""Megatron attention core with anyspeed context parallelism (any device, no TE).

Megatron's local ``DotProductAttention`` refuses ``context_parallel_size > 1`` (its CP lives in
Transformer Engine). This subclass of anyspeed's SDPA core runs ring (``cp_comm_type='p2p'``,
MindSpeed's ``megatron_cp_algo``), Ulysses (``'a2a'``, ``ulysses_cp_algo``) or hybrid
(``'a2a+p2p'``, ``hybrid_cp_algo``, over Megatron's hierarchical CP groups) attention over
Megatron's context-parallel group, on the load-balanced sequence shards that Megatron's
``get_batch_on_this_cp_rank`` produces (RoPE positions follow the same split in Megatron).
"""

from __future__ import annotations

import copy

from megatron.core import parallel_state as ps

from anyspeed.features.context_parallel.hybrid import hybrid_attention
from anyspeed.features.context_parallel.ring import ring_attention
from anyspeed.features.context_parallel.ulysses import ulysses_attention
from anyspeed.features.ops.attention import SDPAttention
from anyspeed.layout import CPAlgo


class CPAttention(SDPAttention):
    """SDPA attention core; with CP > 1 it attends across the context-parallel group."""

    def __init__(self, config, *args, **kwargs) -> None:
        self.cp_size = config.context_parallel_size
        comm = kwargs.get("cp_comm_type") or getattr(config, "cp_comm_type", None) or "p2p"
        if isinstance(comm, list):
            comm = comm[0]
        try:
            self.cp_algo = CPAlgo(comm)
        except ValueError:
            if self.cp_size > 1:
                raise ValueError(
                    f"context-parallel algorithm {comm!r} is not supported here "
                    f"(use one of {[a.value for a in CPAlgo]})"
                ) from None
            self.cp_algo = CPAlgo.RING
        local = copy.copy(config)  # Megatron's base class asserts CP == 1 on its config
        local.context_parallel_size = 1
        super().__init__(local, *args, **kwargs)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if self.cp_size == 1:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        if attention_mask is not None or packed_seq_params is not None:
            raise ValueError(
                "context parallelism supports causal attention without an explicit "
                "mask: drop --reset-attention-mask / padding masks"
            )
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        group = ps.get_context_parallel_group()
        if self.cp_algo is CPAlgo.RING:
            out = ring_attention(q, k, v, self.softmax_scale, group)
        elif self.cp_algo is CPAlgo.HYBRID:
            ulysses_group, ring_group = ps.get_hierarchical_context_parallel_groups()
            out = hybrid_attention(q, k, v, self.softmax_scale, ulysses_group, ring_group)
        else:
            out = ulysses_attention(q, k, v, self.softmax_scale, group, load_balanced=True)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
