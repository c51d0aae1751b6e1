"""Loss reductions every stage uses: masked token sums, sums over context-parallel ranks, and
the model transform that makes Megatron divide gradients by the global token count."""

from __future__ import annotations

from typing import Any

import torch


def per_token_loss(chunk: torch.nn.Module, model: Any) -> torch.nn.Module:
    """Megatron divides the gradients by the global token (or pair) count: a model transform."""
    chunk.config.calculate_per_token_loss = True  # gradients / global token or pair count
    return chunk


def cp_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the context-parallel ranks, with gradients (identity at CP 1)."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() == 1:
        return x
    import torch.distributed.nn.functional as dist_fn

    return dist_fn.all_reduce(x, group=ps.get_context_parallel_group())


def token_loss(losses: torch.Tensor, mask: torch.Tensor):
    """(sum of masked token losses, token count, [sum, count]) of one micro-batch (this
    rank's share of it under context parallelism)."""
    mask = mask.reshape(-1).float()
    total = (losses.float().reshape(-1) * mask).sum()
    count = mask.sum()
    return total, count.to(torch.int), torch.stack([total.detach(), count.detach()])
