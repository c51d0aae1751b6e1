"""SwiGLU as one autograd node that saves only its input.

Megatron's unfused path (``silu(a) * b`` after a chunk) keeps ``a``, ``b`` and ``silu(a)`` alive
for the backward pass; this keeps the [tokens, 2 x ffn] input alone and recomputes the sigmoid,
cutting the MLP's activation memory. Plugged in through Megatron's ``bias_swiglu_impl`` seam
(``bias_activation_fusion``), so the MLP module itself is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _forward(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return F.silu(a).mul_(b)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _forward(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # d/da silu(a) = sig + silu * (1 - sig) = sig * (1 - silu) + silu. Computed in fp32
        # straight into the two halves of one [.., 2 x ffn] buffer: no cat, and one temporary
        # (sig) instead of one per operation, which at this size costs page faults as well.
        (x,) = ctx.saved_tensors
        a, b = x.chunk(2, dim=-1)
        work = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        grad_a, grad_b = work.chunk(2, dim=-1)
        sig = torch.sigmoid(a.float())
        torch.mul(a, sig, out=grad_b)  # silu(a)
        torch.addcmul(grad_b, sig, grad_b, value=-1, out=grad_a)  # silu - sig * silu
        grad_a.add_(sig).mul_(grad).mul_(b)
        grad_b.mul_(grad)
        return work if x.dtype == torch.float32 else work.to(x.dtype)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` with input-only saved state (under no-grad, the same
    forward without the autograd node)."""
    if torch.is_grad_enabled():
        return _SwiGLU.apply(x)
    return _forward(x)


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor | None, *args, **kwargs) -> torch.Tensor:
    """Signature-compatible replacement for Megatron's ``bias_swiglu_impl``."""
    if bias is not None:
        y = y + bias
    shape = y.shape
    return swiglu(y.reshape(-1, shape[-1])).reshape(*shape[:-1], shape[-1] // 2)


def weighted_bias_swiglu(
    y: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor, *args, **kwargs
) -> torch.Tensor:
    """Megatron's ``weighted_bias_swiglu_impl`` (MoE experts scale each token's activation by
    its routing probability): the product in the probabilities' dtype, cast back."""
    if bias is not None:
        raise ValueError("a bias before the weighted SwiGLU is not supported (as in Megatron)")
    shape = y.shape
    out = swiglu(y.reshape(-1, shape[-1])) * weights.reshape(-1, 1)
    return out.to(y.dtype).reshape(*shape[:-1], shape[-1] // 2)
