"""Pipeline point-to-point messages that match by direction on gloo.

Megatron's batched p2p (``_batched_p2p_ops``) posts send-prev, recv-prev, send-next, recv-next in
one batch. gloo matches messages between two ranks by (peer, tag) in posting order, so when the
previous and the next stage are the same rank (PP=2 with the interleaved schedule) an activation
sent "next" can land in the buffer the peer posted for a gradient coming from its "next". Giving
each direction its own tag (activations travel with one, gradients with the other) makes matching
independent of posting order, and the numbers identical to a single-process run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

# Forward-direction traffic (to next / from prev) and backward-direction traffic (to prev / from
# next) use distinct tags.
TAG_TO_NEXT = 7301
TAG_TO_PREV = 7302


def tagged_batched_p2p_ops(original: Callable) -> Callable:
    """Wrap ``_batched_p2p_ops``: on gloo groups post the same ops with per-direction tags."""

    @functools.wraps(original)
    def batched_p2p_ops(
        *,
        tensor_send_prev: torch.Tensor | None,
        tensor_recv_prev: torch.Tensor | None,
        tensor_send_next: torch.Tensor | None,
        tensor_recv_next: torch.Tensor | None,
        group: dist.ProcessGroup,
        prev_pipeline_rank: int,
        next_pipeline_rank: int,
    ):
        if dist.get_backend(group) != "gloo":
            return original(
                tensor_send_prev=tensor_send_prev,
                tensor_recv_prev=tensor_recv_prev,
                tensor_send_next=tensor_send_next,
                tensor_recv_next=tensor_recv_next,
                group=group,
                prev_pipeline_rank=prev_pipeline_rank,
                next_pipeline_rank=next_pipeline_rank,
            )
        plan = (
            (dist.isend, tensor_send_prev, prev_pipeline_rank, TAG_TO_PREV),
            (dist.irecv, tensor_recv_prev, prev_pipeline_rank, TAG_TO_NEXT),
            (dist.isend, tensor_send_next, next_pipeline_rank, TAG_TO_NEXT),
            (dist.irecv, tensor_recv_next, next_pipeline_rank, TAG_TO_PREV),
        )
        ops = [dist.P2POp(op, t, peer, group, tag) for op, t, peer, tag in plan if t is not None]
        return dist.batch_isend_irecv(ops) if ops else []

    return batched_p2p_ops
