"""Distillation's vocabulary-parallel pieces inside spawned ranks (importable by name)."""

from __future__ import annotations

import torch


def topk_logprobs(k: int) -> dict:
    """The teacher-side top-k ids and the log-probabilities at them from this rank's shard of
    seeded logits [5, 2, 40] (the last 3 columns padding, at -inf), with the gradient of a
    weighted sum of those log-probabilities, at TP = the world size."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from anyspeed.models.logprobs import vocab_parallel_logprobs_at, vocab_parallel_topk

    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    g = torch.Generator().manual_seed(11)
    full = torch.randn(5, 2, 40, generator=g) * 3
    full[..., 37:] = float("-inf")
    weights = torch.rand(5, 2, k, generator=g)
    shard = full.chunk(tp, -1)[ps.get_tensor_model_parallel_rank()].clone().requires_grad_()
    ids = vocab_parallel_topk(shard, k)
    lp = vocab_parallel_logprobs_at(shard, ids)
    (weights * lp).sum().backward()
    return {"ids": ids.tolist(), "logp": lp.tolist(), "grad": shard.grad.tolist()}
