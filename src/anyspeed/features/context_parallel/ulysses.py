"""Ulysses context parallelism: trade sequence shards for head shards around attention.

Each rank holds a contiguous sequence shard of every head. An all-to-all gives each rank the
whole sequence for 1/CP of the heads; attention runs locally; a second all-to-all restores the
sequence shards. When K/V have fewer heads than CP (GQA), they are replicated up to the query
heads first so each rank receives the K/V its query heads use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h, s/cp, d] -> [b, h/cp, s, d]."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # [cp, b, h/cp, s, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j] = rank j's sequence shard
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h/cp, s, d] -> [b, h, s/cp, d] (inverse of :func:`_seq_to_heads`)."""
    cp = dist.get_world_size(group)
    b, hl, s, d = x.shape
    send = x.reshape(b, hl, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j] = my shard of rank j's heads
    return recv.transpose(0, 1).reshape(b, cp * hl, s // cp, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def _balanced_order(cp: int, s: int, device) -> torch.Tensor:
    """Positions, in the gathered load-balanced layout, of the tokens in sequence order.

    Gathered from the ranks, chunk 2r is sequence chunk r and chunk 2r+1 is chunk 2cp-1-r.
    """
    c = s // (2 * cp)
    where = [0] * (2 * cp)
    for r in range(cp):
        where[r], where[2 * cp - 1 - r] = 2 * r, 2 * r + 1
    return torch.cat([torch.arange(w * c, (w + 1) * c, device=device) for w in where])


def ulysses_around(q, k, v, group, core, load_balanced: bool) -> torch.Tensor:
    """Run ``core(qh, kh, vh)`` on head shards of the whole (group-gathered) sequence.

    The all-to-all trades sequence shards q [b,h,s/u,d], k/v [b,hkv,s/u,d] for head shards
    and back; K/V are replicated when they have fewer heads than the degree. With
    ``load_balanced`` the shards are Megatron's two-chunk split: the gathered sequence is put
    in order for ``core`` and back after.
    """
    u = dist.get_world_size(group)
    h, hkv = q.shape[1], k.shape[1]
    if h % u:
        raise ValueError(f"attention heads {h} are not divisible by the Ulysses degree {u}")
    if hkv % u:  # too few K/V heads to split: replicate them to the query heads
        k, v = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
    qh, kh, vh = (_SeqToHeads.apply(t, group) for t in (q, k, v))
    order = _balanced_order(u, qh.shape[2], qh.device) if load_balanced else None
    if order is not None:
        qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))
    out = core(qh, kh, vh)
    if order is not None:
        out = out.index_select(2, torch.argsort(order))
    return _HeadsToSeq.apply(out, group)


def ulysses_attention(q, k, v, scale: float, group, load_balanced: bool = False) -> torch.Tensor:
    """Causal attention of sequence shards q [b,h,s/cp,d], k/v [b,hkv,s/cp,d].

    Shards are contiguous, or (``load_balanced``) Megatron's two-chunk split used with ring
    attention.
    """

    def core(qh, kh, vh):
        return F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=qh.shape[1] != kh.shape[1]
        )

    return ulysses_around(q, k, v, group, core, load_balanced)
