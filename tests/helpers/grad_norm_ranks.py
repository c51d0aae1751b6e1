"""Rank function for the grad-norm tests (spawned, so importable by name)."""

from __future__ import annotations

import torch


def output_layer_grads(seed: int = 0) -> list[torch.Tensor]:
    """A gradient the size of a 32k x 128 output layer (Adam-scale values, a few rows large)
    and a norm weight's, as one process holds them."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(32000, 128, generator=g) * 1e-4
    out[:64] *= 100.0  # the tokens of the batch
    return [out, torch.randn(128, generator=g) * 1e-3]


def tp_grad_norms(seed: int = 0) -> dict[str, float]:
    """Megatron's ``get_grad_norm_fp32`` of :func:`output_layer_grads`: whole in one process
    (a group of rank 0 alone), and split by rows over the world as tensor parallelism splits
    an output layer (the norm weight, duplicated, counted on rank 0 only)."""
    import torch.distributed as dist
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    alone = dist.new_group(ranks=[0])
    out, norm_w = output_layer_grads(seed)
    shard = out.chunk(world)[rank].clone()
    sharded = get_grad_norm_fp32([shard, norm_w] if rank == 0 else [shard])
    result = {"sharded": float(sharded)}
    if rank == 0:
        result["whole"] = float(get_grad_norm_fp32([out, norm_w], grad_stats_parallel_group=alone))
        result["exact"] = float(torch.cat([out.reshape(-1), norm_w]).double().norm())
    return result
