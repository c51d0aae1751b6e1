"""SwiGLU as one autograd node that saves only its input.

Megatron's unfused path (``silu(a) * b`` after a chunk) keeps ``a``, ``b`` and ``silu(a)`` alive
for the backward pass; this keeps the [tokens, 2 x ffn] input alone and recomputes the sigmoid,
cutting the MLP's activation memory. Plugged in through Megatron's ``bias_swiglu_impl`` seam
(``bias_activation_fusion``), so the MLP module itself is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        a, b = x.chunk(2, dim=-1)
        af = a.float()
        sig = torch.sigmoid(af)
        silu = af * sig
        g = grad.float()
        grad_a = g * b.float() * sig * (1 + af * (1 - sig))
        grad_b = g * silu
        return torch.cat((grad_a, grad_b), dim=-1).to(x.dtype)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` with input-only saved state."""
    return _SwiGLU.apply(x)


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None, *args, **kwargs) -> torch.Tensor:
    """Signature-compatible replacement for Megatron's ``bias_swiglu_impl``."""
    if bias is not None:
        y = y + bias
    shape = y.shape
    return swiglu(y.reshape(-1, shape[-1])).reshape(*shape[:-1], shape[-1] // 2)
