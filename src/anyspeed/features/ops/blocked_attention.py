"""Blocked (flash-style) attention with dropout, for devices whose fused kernel has none.

PyTorch's fused CPU attention kernels refuse dropout, so ``scaled_dot_product_attention`` with
``dropout_p > 0`` falls back to the math kernel, which keeps the [b, heads, s, s] probabilities
and dropout mask for backward. Here the keys are walked in blocks, each scored against all the
query rows that can see it (an [s, block] slab: few, large ops), with an online softmax: forward
keeps only q, k, v, the output and one log-sum-exp per query (memory linear in
the sequence); backward recomputes each block's probabilities and regenerates its dropout mask
from a per-key-block ``torch.Generator`` seeded from one seed drawn from the device's RNG (so
Megatron's RNG-tracker fork still decides the masks: different per TP rank, advancing per call).
Causal (top-left, as SDPA), boolean keep masks (padding, packed-document masks) and grouped-query
attention are supported; dropout is applied to the normalised probabilities, as in the math path.
Two GPT-OSS terms too: a learnable per-head sink (a logit in the softmax's denominator with no
value: the online softmax starts from it) and a causal sliding window (a row sees the ``window``
keys before it and itself; key blocks outside every row's window are not scored).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

BLOCK = 256
_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = 2**63 - 1


def block_seed(seed: int, ki: int) -> int:
    """The generator seed of key block ``ki``."""
    return (seed + (ki + 1) * _GOLDEN) & _MASK63


def _threshold(p: float) -> int:
    """Dropout threshold on uniform int16 draws: P(draw < threshold) = p, to within 2**-16."""
    return round(p * 65536) - 32768


def block_drop(
    shape: tuple[int, ...], p: float, seed: int, ki: int, device: torch.device
) -> torch.Tensor:
    """Boolean drop-mask of one key block (True = dropped), regenerated identically in
    backward: uniform 16-bit draws (four per 64-bit draw of a generator seeded per block) below
    the threshold of ``p``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(block_seed(seed, ki))
    n = math.prod(shape)
    words = torch.randint(
        -(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64, generator=gen, device=device
    )
    return words.view(torch.int16)[:n].view(shape) < _threshold(p)


def _first_row(ks: int, causal: bool) -> int:
    """The first query row that can see key block ``ks`` (top-left causal: row >= key)."""
    return ks if causal else 0


def full_keep(
    b: int,
    heads: int,
    sq: int,
    sk: int,
    p: float,
    seed: int,
    block: int = BLOCK,
    causal: bool = False,
    device: str = "cpu",
) -> torch.Tensor:
    """The whole [b, heads, sq, sk] dropout multiplier (0 or 1/(1-p)) the blocked kernel uses
    for a ``causal`` or non-causal call, for references and tests (rows a causal block cannot
    reach are 1: they are masked anyway)."""
    out = torch.ones(b, heads, sq, sk, device=device) / (1.0 - p)
    for ki, ks in enumerate(range(0, sk, block)):
        ke, r0 = min(ks + block, sk), _first_row(ks, causal)
        if r0 < sq:
            drop = block_drop((b, heads, sq - r0, ke - ks), p, seed, ki, torch.device(device))
            out[:, :, r0:, ks:ke] = (~drop).float() / (1.0 - p)
    return out


class _Ctx:
    """What both passes need to score one key block against the query rows that see it."""

    def __init__(
        self, q5, k, v, keep, causal, scale, p, seed, block, sink=None, window=None, cap=None
    ):
        self.q5, self.k, self.v, self.keep = q5, k, v, keep
        self.cap = cap  # soft-capping of the scores, cap * tanh(s / cap) (Gemma 2), or None
        self.causal, self.scale, self.p, self.seed, self.block = causal, scale, p, seed, block
        self.qs = q5 * scale  # the softmax scale folded into q once
        # the sink logit per head as [1, hkv, g, 1] (fp32), or None
        self.sink = None if sink is None else sink.float().view(1, *q5.shape[1:3], 1)
        self.window = window

    def blocks(self) -> Iterator[tuple[int, int, int, int, int]]:
        """(index, first key, end key, first and end query row) of every key block some row
        sees (with a window, rows past ``end key + window`` see none of it)."""
        sq, sk = self.q5.shape[3], self.k.shape[2]
        for ki, ks in enumerate(range(0, sk, self.block)):
            r0, ke = _first_row(ks, self.causal), min(ks + self.block, sk)
            r1 = sq if self.window is None else min(sq, ke + self.window)
            if r0 < r1:
                yield ki, ks, ke, r0, r1

    def scores(self, ks: int, ke: int, r0: int, r1: int):
        """Masked fp32 scores [b, hkv, g, rows, bk] of rows [r0, r1) vs keys [ks, ke), with the
        k and v blocks."""
        kb = self.k[:, :, ks:ke].unsqueeze(2)
        vb = self.v[:, :, ks:ke].unsqueeze(2)
        s = torch.matmul(self.qs[..., r0:r1, :], kb.transpose(-1, -2)).float()
        if self.cap:
            s.div_(self.cap).tanh_().mul_(self.cap)
        if self.keep is not None:
            s.masked_fill_(~self.keep[..., r0:r1, ks:ke], float("-inf"))
        if self.causal:  # only the first rows (r0 = ks) see part of the block
            n = min(ke - ks, s.shape[-2])
            above = torch.ones(n, ke - ks, dtype=torch.bool, device=s.device).triu_(1)
            s[..., :n, :].masked_fill_(above, float("-inf"))
        if self.window is not None:  # keys more than `window` before the row
            rows = torch.arange(r0, r1, device=s.device).unsqueeze(1)
            far = rows - torch.arange(ks, ke, device=s.device) > self.window
            s.masked_fill_(far, float("-inf"))
        return s, kb, vb

    def dropout(self, ki: int, probs: torch.Tensor) -> torch.Tensor:
        """Drop-mask of a key block, shaped like ``probs``."""
        b, hkv, g, rows, bk = probs.shape
        return block_drop((b, hkv * g, rows, bk), self.p, self.seed, ki, probs.device).view(
            probs.shape
        )


def _forward(c: _Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    q5, v = c.q5, c.v
    m = torch.full(q5.shape[:-1], float("-inf"), device=q5.device)
    total = torch.zeros_like(m)
    if c.sink is not None:  # the sink is a key every row sees first: exp(sink - m) = 1
        m.copy_(c.sink.expand_as(m))
        total.fill_(1.0)
    acc = torch.zeros(*m.shape, v.shape[-1], device=q5.device)
    for ki, ks, ke, r0, r1 in c.blocks():
        s, _, vb = c.scores(ks, ke, r0, r1)
        m_old = m[..., r0:r1]
        m_new = torch.maximum(m_old, s.amax(-1))
        m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)
        probs = s.sub_(m_safe.unsqueeze(-1)).exp_()
        alpha = torch.exp(m_old - m_safe)
        total[..., r0:r1].mul_(alpha).add_(probs.sum(-1))
        if c.p > 0:
            probs.masked_fill_(c.dropout(ki, probs), 0.0)
        acc[..., r0:r1, :].mul_(alpha.unsqueeze(-1)).add_(torch.matmul(probs.to(vb.dtype), vb))
        m[..., r0:r1] = m_new
    empty = total == 0  # a row that sees no key: output 0, no gradient
    kept = total.masked_fill(empty, 1.0) * (1.0 - c.p)  # 1/(1-p) of the kept probabilities
    out = (acc / kept.unsqueeze(-1)).to(q5.dtype)
    lse = (m + torch.log(total)).masked_fill(empty, float("inf"))
    return out, lse


def _sum_groups(x: torch.Tensor) -> torch.Tensor:
    """[b, hkv, g, ...] -> [b, hkv, ...]: the query heads of a KV group add up."""
    return x.squeeze(2) if x.shape[2] == 1 else x.sum(2)


def _backward(c: _Ctx, out, lse, grad):
    q5, k, v = c.q5, c.k, c.v
    delta = (grad.float() * out.float()).sum(-1)
    grad = (grad * (1.0 / (1.0 - c.p))).float()  # the dropout scale, folded into dO
    dq = torch.zeros(q5.shape, device=q5.device)
    dk = torch.empty(k.shape, device=k.device)
    dv = torch.empty(v.shape, device=v.device)
    for ki, ks, ke, r0, r1 in c.blocks():
        s, kb, vb = c.scores(ks, ke, r0, r1)
        slope = None  # d capped / d raw score = 1 - tanh^2 (0 where masked)
        if c.cap:
            slope = torch.where(torch.isinf(s), 0.0, 1.0 - (s / c.cap).square())
        probs = s.sub_(lse[..., r0:r1].unsqueeze(-1)).exp_()
        gb = grad[..., r0:r1, :]
        dprobs = torch.matmul(gb, vb.transpose(-1, -2).float())
        dropped = probs
        if c.p > 0:
            drop = c.dropout(ki, probs)
            dropped = probs.masked_fill(drop, 0.0)
            dprobs.masked_fill_(drop, 0.0)
        dv[:, :, ks:ke] = _sum_groups(torch.matmul(dropped.transpose(-1, -2), gb))
        ds = probs.mul_(dprobs.sub_(delta[..., r0:r1].unsqueeze(-1)))
        if slope is not None:
            ds.mul_(slope)
        dq[..., r0:r1, :] += torch.matmul(ds, kb.float())
        qb = c.qs[..., r0:r1, :].float()
        dk[:, :, ks:ke] = _sum_groups(torch.matmul(ds.transpose(-1, -2), qb))
    if c.causal and q5.shape[3] < k.shape[2]:  # key blocks no row sees
        first = -(-q5.shape[3] // c.block) * c.block
        dk[:, :, first:] = 0
        dv[:, :, first:] = 0
    dsink = None
    if c.sink is not None:  # d/d sink = p_sink (0 - delta): the sink carries no value
        dsink = -(torch.exp(c.sink - lse) * delta).sum((0, 3)).reshape(-1)
    return dq.mul_(c.scale), dk, dv, dsink


class BlockedAttention(torch.autograd.Function):
    """softmax(q k^T * scale + mask) with dropout, @ v; q [b, hq, s, d], k/v [b, hkv, s, d]."""

    @staticmethod
    def forward(ctx, q, k, v, keep, causal, scale, p, seed, block, sink, window, cap):
        b, hq, sq, d = q.shape
        q5 = q.reshape(b, k.shape[1], hq // k.shape[1], sq, d)
        keep5 = None if keep is None else _mask5(keep, q5.shape)
        c = _Ctx(q5, k, v, keep5, causal, scale, p, seed, block, sink, window, cap)
        out, lse = _forward(c)
        ctx.save_for_backward(q, k, v, keep, out, lse, sink)
        ctx.args = (causal, scale, p, seed, block)
        ctx.window, ctx.cap = window, cap
        return out.view(b, hq, sq, v.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        q, k, v, keep, out, lse, sink = ctx.saved_tensors
        q5 = q.reshape(*out.shape[:-1], q.shape[-1])
        keep5 = None if keep is None else _mask5(keep, q5.shape)
        causal, scale, p, seed, block = ctx.args
        c = _Ctx(q5, k, v, keep5, causal, scale, p, seed, block, sink, ctx.window, ctx.cap)
        dq, dk, dv, dsink = _backward(c, out, lse, grad.reshape(out.shape).to(q.dtype))
        dq = dq.view(q.shape).to(q.dtype)
        dsink = None if dsink is None else dsink.to(sink.dtype)
        return (dq, dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 6 + (dsink, None, None)


def _mask5(keep: torch.Tensor, shape5: torch.Size) -> torch.Tensor:
    """A keep-mask broadcastable to [b, hq, sq, sk] as [b, hkv|1, g|1, sq, sk]."""
    if keep.dim() == 2:
        keep = keep[None, None]
    b, heads = keep.shape[:2]
    if heads == 1:
        return keep.unsqueeze(2)
    return keep.reshape(b, shape5[1], shape5[2], *keep.shape[-2:])


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    block: int = BLOCK,
    sink: torch.Tensor | None = None,
    window: int | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """Attention like ``F.scaled_dot_product_attention`` (``keep``: boolean, True = attend),
    computed in blocks; the dropout seed is drawn from the device's current RNG when not given.
    ``sink``: one logit per query head added to each row's softmax denominator (GPT-OSS);
    ``window``: causal sliding window, a row sees itself and the ``window`` keys before it;
    ``cap``: scores soft-capped as ``cap * tanh(s / cap)`` before the mask (Gemma 2)."""
    if window is not None and not causal:
        raise ValueError("blocked attention: a sliding window is causal here (causal=True)")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), device=q.device))
    return BlockedAttention.apply(
        q, k, v, keep, causal, scale, dropout_p, seed, block, sink, window, cap
    )


def fused_has_dropout(device: torch.device) -> bool:
    """Whether the device's fused SDPA kernels implement dropout (CUDA's do; the CPU's not)."""
    return device.type == "cuda"


def dropout_path(device_type: str) -> str:
    """Which kernel attention with dropout uses on ``device_type`` (for ``anyspeed features``)."""
    if fused_has_dropout(torch.device(device_type)):
        return "attention dropout: the fused SDPA kernel's own"
    return (
        f"attention dropout > 0: blocked attention, masks regenerated in backward ({device_type}'s "
        "fused kernels have no dropout)"
    )
