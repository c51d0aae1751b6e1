"""Ring attention with a load-balanced causal split and an explicit backward pass.

The sequence is cut into 2 x CP chunks; rank r holds chunks r and 2CP-1-r, so every rank has
the same amount of causal work. K/V blocks travel around the ring (in the forward pass the next
block is received while the current one is computed); partial outputs merge by log-sum-exp.
The backward pass circulates K/V again with their gradient accumulators, which return to their
owner at the end:
no rank ever holds more than two K/V blocks, and nothing of the forward ring is kept but the
local output and log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from anyspeed.features.context_parallel.attention_math import block_grads, merge, partial_attention


def split_load_balanced(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's two chunks (r and 2CP-1-r) of ``x`` along ``dim``."""
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * world - 1 - rank]), dim=dim)


def _ring_pass(tensors, group):
    """Start sending ``tensors`` to the next rank and receiving the previous rank's."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recv]
    return recv, dist.batch_isend_irecv(ops)


def _step_plan(rank: int, src: int, c: int):
    """(query slice, key slice, causal) for the block of ``src`` seen by ``rank``; None if none."""
    if src == rank:
        return slice(0, 2 * c), slice(0, 2 * c), True
    if src < rank:  # both local chunks see the source's early chunk, fully
        return slice(0, 2 * c), slice(0, c), False
    return slice(c, 2 * c), slice(0, 2 * c), False  # only the late chunk sees it, fully


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // 2
        out = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:3], float("-inf"))
        kv = (k, v)
        for i in range(world):
            reqs = None
            if i + 1 < world:
                nxt_kv, reqs = _ring_pass(kv, group)
            src = (rank - i) % world
            qs, ks, causal = _step_plan(rank, src, c)
            bo, bl = partial_attention(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], scale, causal)
            o, l_ = merge(out[:, :, qs], lse[:, :, qs], bo, bl)
            out[:, :, qs], lse[:, :, qs] = o, l_
            if reqs is not None:
                for r in reqs:
                    r.wait()
                kv = tuple(nxt_kv)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group = scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32)
        kv = (k, v)
        acc = [torch.zeros(k.shape, dtype=torch.float32), torch.zeros(v.shape, dtype=torch.float32)]
        for i in range(world):
            # K/V for the next block travel while this block computes; the gradient
            # accumulators follow their K/V once this block's share is added. After the last
            # block, one more hop brings each accumulator home to its owner.
            kv_reqs = None
            if i + 1 < world:
                nxt_kv, kv_reqs = _ring_pass(kv, group)
            src = (rank - i) % world
            qs, ks, causal = _step_plan(rank, src, c)
            gq, gk, gv = block_grads(
                q[:, :, qs],
                kv[0][:, :, ks],
                kv[1][:, :, ks],
                grad[:, :, qs],
                out[:, :, qs],
                lse[:, :, qs],
                scale,
                causal,
            )
            dq[:, :, qs] += gq
            acc[0][:, :, ks] += gk
            acc[1][:, :, ks] += gv
            acc, reqs = _ring_pass(acc, group)
            for r in reqs:
                r.wait()
            if kv_reqs is not None:
                for r in kv_reqs:
                    r.wait()
                kv = tuple(nxt_kv)
        dk, dv = acc
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q, k, v, scale: float, group) -> torch.Tensor:
    """Causal attention of load-balanced local shards q [b,h,2c,d], k/v [b,hkv,2c,d]."""
    return _RingAttention.apply(q, k, v, scale, group)
