"""Rotary position embedding applied in one autograd node.

RoPE is linear in its input: ``out = t * cos + rotate_half(t) * sin``. The backward pass is the
same rotation transposed, so this node saves only ``cos``/``sin`` (one per call, shared by every
head) rather than the input and intermediate products that Megatron's unfused path keeps.
Rope scaling (LLaMA-3, YaRN factors) is already folded into the frequencies Megatron computes.
Plugged in through Megatron's ``fused_apply_rotary_pos_emb`` seam (``apply_rope_fusion``).
"""

from __future__ import annotations

import torch


def _rotate(t: torch.Tensor, interleaved: bool, sign: float) -> torch.Tensor:
    """``sign=+1``: rotate_half; ``sign=-1``: its transpose."""
    if interleaved:
        x1, x2 = t[..., 0::2], t[..., 1::2]
        return torch.stack((-sign * x2, sign * x1), dim=-1).flatten(-2)
    x1, x2 = t.chunk(2, dim=-1)
    return torch.cat((-sign * x2, sign * x1), dim=-1)


def _rotate_into(
    out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool
) -> None:
    """``out = x * cos + R(x) * sin`` (``R`` = rotate_half, or its transpose), half by half
    straight into ``out``: no cat and no rotated copy of ``x``."""
    h = x.shape[-1] // 2
    x1, x2, o1, o2 = x[..., :h], x[..., h:], out[..., :h], out[..., h:]
    c1, c2, s1, s2 = cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:]
    torch.mul(x1, c1, out=o1)
    torch.mul(x2, c2, out=o2)
    if transpose:  # R^T(y) = [y2; -y1]
        o1.addcmul_(x2, s2)
        o2.addcmul_(x1, s1, value=-1)
    else:  # R(y) = [-y2; y1]
        o1.addcmul_(x2, s1, value=-1)
        o2.addcmul_(x1, s2)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``t`` rotated by the angles whose ``cos``/``sin`` [.., rot] are given (the rest passes)."""
    rot = cos.shape[-1]
    head, tail = t[..., :rot], t[..., rot:]
    if interleaved:
        out = head * cos + _rotate(head, interleaved, 1.0) * sin
        return torch.cat((out, tail), dim=-1) if tail.shape[-1] else out
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    _rotate_into(out[..., :rot], head, cos, sin, transpose=False)
    if tail.shape[-1]:
        out[..., rot:] = tail
    return out


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
        cos = torch.cos(freqs).to(t.dtype)
        sin = torch.sin(freqs).to(t.dtype)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rope(t, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        rot = cos.shape[-1]
        g_head, g_tail = grad[..., :rot], grad[..., rot:]
        if ctx.interleaved:
            g = g_head * cos + _rotate(g_head * sin, ctx.interleaved, -1.0)
            return (torch.cat((g, g_tail), dim=-1) if g_tail.shape[-1] else g), None, None
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        _rotate_into(out[..., :rot], g_head, cos, sin, transpose=True)
        if g_tail.shape[-1]:
            out[..., rot:] = g_tail
        return out, None, None


def signed_tables(
    freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``[-sin | sin]`` of ``freqs`` in ``dtype``: rotate_half's signs folded into
    the sine, for :func:`rotate` (compute once per rotary table when decoding); both times
    ``mscale`` (YaRN's and LongRoPE's attention factor) before the cast, as Megatron scales."""
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    cos, sin = cos.to(dtype), sin.to(dtype)
    h = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)


def cached_signed_tables(
    freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0
) -> tuple[torch.Tensor, ...]:
    """:func:`signed_tables` of ``freqs``, computed once per dtype and factor and kept on the
    tensor (Megatron caches one rotary table per length, so decoding computes each once)."""
    cache = freqs.__dict__.setdefault("_anyspeed_signed_tables", {})
    if (dtype, mscale) not in cache:
        cache[dtype, mscale] = signed_tables(freqs, dtype, mscale)
    return cache[dtype, mscale]


def rotate(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``t * cos + rotate_half(t) * sin`` (non-interleaved; dims past ``cos``'s pass) in four
    tensor ops, from :func:`signed_tables`; no autograd node (for no-grad paths)."""
    rot = cos.shape[-1]
    head = t[..., :rot] if rot < t.shape[-1] else t
    out = head * cos
    out.add_(head.roll(rot // 2, dims=-1) * signed_sin)  # roll: [x2, x1]; the sine has the signs
    return torch.cat((out, t[..., rot:]), dim=-1) if rot < t.shape[-1] else out


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate ``t`` [s, b, heads, d] by ``freqs`` [s, 1, 1, rot] (rot <= d; the rest passes).
    Under no-grad (decoding) the same rotation runs without the autograd node."""
    if torch.is_grad_enabled():
        return _RoPE.apply(t, freqs, interleaved)
    if interleaved:
        return _rope(t, torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype), interleaved)
    return rotate(t, *signed_tables(freqs, t.dtype))


def fused_apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    transpose_output_memory: bool = False,
    interleaved: bool = False,
    **kwargs,
) -> torch.Tensor:
    """Signature-compatible with the Transformer Engine entry Megatron calls when fused."""
    return apply_rope(t, freqs, interleaved)
