"""Vocabulary-parallel cross-entropy without a full-precision copy of the logits.

Megatron's local path upcasts the whole [tokens, vocab/TP] logits to fp32 and keeps that copy
(as the softmax) for the backward pass. Here the logits stay in their own dtype; max, sum-exp
and the target logit are computed in fp32 over row chunks and reduced across the TP group as
[tokens] vectors; the backward pass rebuilds the softmax chunk by chunk from the saved
log-sum-exp. The loss is the same number.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_ROWS = 1024


def _tp(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        rank, world = _tp(group)
        shape = target.shape
        x = logits.reshape(-1, logits.shape[-1])
        t = target.reshape(-1)
        part = x.shape[-1]
        start = rank * part
        local = t - start
        inside = (local >= 0) & (local < part)
        local = local.clamp(0, part - 1)
        n = x.shape[0]
        mx = torch.empty(n, dtype=torch.float32, device=x.device)
        for i in range(0, n, CHUNK_ROWS):
            mx[i : i + CHUNK_ROWS] = x[i : i + CHUNK_ROWS].amax(dim=-1).float()
        if world > 1:
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        sumexp = torch.empty_like(mx)
        picked = torch.empty_like(mx)
        for i in range(0, n, CHUNK_ROWS):
            xc = x[i : i + CHUNK_ROWS].float()
            sumexp[i : i + CHUNK_ROWS] = (xc - mx[i : i + CHUNK_ROWS, None]).exp().sum(dim=-1)
            pc = xc.gather(1, local[i : i + CHUNK_ROWS, None]).squeeze(1)
            picked[i : i + CHUNK_ROWS] = torch.where(inside[i : i + CHUNK_ROWS], pc, 0.0)
        if world > 1:
            dist.all_reduce(sumexp, group=group)
            dist.all_reduce(picked, group=group)
        lse = mx + sumexp.log()
        ctx.save_for_backward(logits, local, inside, lse)
        return (lse - picked).reshape(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, local, inside, lse = ctx.saved_tensors
        x = logits.reshape(-1, logits.shape[-1])
        g = grad.reshape(-1).float()
        out = torch.empty_like(x)
        rows = torch.arange(x.shape[0], device=x.device)
        for i in range(0, x.shape[0], CHUNK_ROWS):
            sl = slice(i, i + CHUNK_ROWS)
            p = (x[sl].float() - lse[sl, None]).exp()
            r = rows[sl] - i
            hit = inside[sl]
            p[r[hit], local[sl][hit]] -= 1.0
            out[sl] = (p * g[sl, None]).to(x.dtype)
        return out.reshape(logits.shape), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None):
    """Per-token loss [s, b] of vocab-parallel ``logits`` [s, b, vocab/TP] against ``target``."""
    return _VocabParallelCE.apply(logits, target, group)
