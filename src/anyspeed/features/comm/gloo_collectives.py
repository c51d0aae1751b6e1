"""The distributed optimizer's collectives as in-place all-reduces under gloo.

Megatron's distributed optimizer reduce-scatters each gradient bucket into this rank's shard of
the same buffer, and all-gathers the updated parameters from this rank's shard of the parameter
buffer. gloo implements both collectives far more slowly than its all-reduce. Measured on this
2-core machine with 2 ranks and 55M fp32 elements: reduce-scatter 0.30 s and all-gather 0.28 s,
against 0.13 s for a full all-reduce. Both can be written as that all-reduce, exactly:

* reduce-scatter into a shard view of the input is an all-reduce of the input in place. The shard
  then holds the reduced values, and the rest of the gradient buffer is not read before it is
  zeroed for the next step;
* all-gather from a shard view of the output is an all-reduce (sum) of the output after every
  other shard is zeroed: each element is its owner's value plus zeros.

The rewrite applies only when the group's backend is gloo and the shard really is this rank's
slice of the buffer (Megatron's layout). Any other call goes to torch unchanged. Numerically the
sum is the same for two ranks. With more ranks only the order of the fp32 additions may differ,
as it would between two gloo algorithms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def _own_shard(shard: torch.Tensor, full: torch.Tensor, group) -> tuple[int, int] | None:
    """(start, end) element range when ``shard`` is this rank's slice of ``full``, else None."""
    if dist.get_backend(group) != "gloo" or shard.dtype != full.dtype:
        return None
    if not (shard.is_contiguous() and full.is_contiguous()):
        return None
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = shard.numel()
    if n * world != full.numel():
        return None
    if shard.data_ptr() != full.data_ptr() + rank * n * full.element_size():
        return None
    return rank * n, (rank + 1) * n


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, *, _orig):
    """``reduce_scatter_tensor`` that is an in-place all-reduce for Megatron's shard views."""
    if _own_shard(output, input, group) is None:
        return _orig(output, input, op=op, group=group, async_op=async_op)
    return dist.all_reduce(input, op=op, group=group, async_op=async_op)


def all_gather(output, input, group=None, async_op=False, *, _orig):
    """``all_gather_into_tensor`` that is an all-reduce of the zero-filled rest."""
    span = _own_shard(input, output, group)
    if span is None:
        return _orig(output, input, group=group, async_op=async_op)
    flat = output.view(-1)
    flat[: span[0]].zero_()
    flat[span[1] :].zero_()
    return dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def bind(fn: Callable, orig: Callable) -> Callable:
    """``fn`` with torch's own collective ``orig`` bound as its fallback."""

    def call(output, input, *args, **kwargs):
        return fn(output, input, *args, **kwargs, _orig=orig)

    call.__name__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call
