"""Vocabulary-parallel cross-entropy without a full-precision copy of the logits.

Megatron's local path upcasts the whole [tokens, vocab/TP] logits to fp32 (a second, 2x-sized
copy for bf16 logits) and keeps it as the softmax for the backward pass. Here max, sum-exp and
the target logit are computed in fp32 one row chunk at a time and reduced across the TP group as
[tokens] vectors; exp(logit - max) and then the gradient are written back into the logits' own
storage, so no logits-sized tensor is ever allocated. The loss is the same number.
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
    # Like Megatron's implementation, this works in place on the logits (their storage holds
    # exp(logit - max) after forward and the gradient after backward): the loss is the only
    # consumer of the output layer's result, and reusing it avoids any logits-sized copy.
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        rank, world = _tp(group)
        shape = target.shape
        x = logits.view(-1, logits.shape[-1])
        t = target.reshape(-1)
        part = x.shape[-1]
        local = t - rank * part
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
            sl = slice(i, i + CHUNK_ROWS)
            xc = x[sl].float().sub_(mx[sl, None])  # fp32 for this chunk only
            pc = xc.gather(1, local[sl, None]).squeeze(1)
            picked[sl] = torch.where(inside[sl], pc, 0.0)
            xc.exp_()
            sumexp[sl] = xc.sum(dim=-1)
            x[sl] = xc  # keep exp(logit - max) for the backward pass, in the logits' dtype
        if world > 1:
            dist.all_reduce(sumexp, group=group)
            dist.all_reduce(picked, group=group)
        ctx.save_for_backward(logits, local, inside, sumexp)
        return (sumexp.log() - picked).reshape(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, local, inside, sumexp = ctx.saved_tensors
        x = logits.view(-1, logits.shape[-1])
        g = grad.reshape(-1).float()
        rows = torch.arange(x.shape[0], device=x.device)
        for i in range(0, x.shape[0], CHUNK_ROWS):
            sl = slice(i, i + CHUNK_ROWS)
            p = x[sl].float().div_(sumexp[sl, None])  # softmax
            hit = inside[sl]
            p[(rows[sl] - i)[hit], local[sl][hit]] -= 1.0
            x[sl] = p.mul_(g[sl, None])
        return logits, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None):
    """Per-token loss [s, b] of vocab-parallel ``logits`` [s, b, vocab/TP] against ``target``."""
    return _VocabParallelCE.apply(logits, target, group)
