"""LayerNorm / RMSNorm for Megatron's local spec that also works with sequence parallelism.

Megatron's ``WrappedTorchNorm`` (used when neither Transformer Engine nor apex is installed)
refuses ``--sequence-parallel``: with the sequence split across tensor-parallel ranks each rank
sees only part of the tokens, so the norm weights' gradients are partial and must be summed over
the TP group. This module marks its parameters ``sequence_parallel`` so Megatron's
``finalize_model_grads`` does that all-reduce, exactly as it does for Transformer Engine's norms.

Its RMSNorm goes through :func:`rms_norm`, ``F.rms_norm`` unless the level-1 ``fused-norm``
feature replaces it by :func:`fused_rms_norm`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, shape: tuple[int], w: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm :class:`DeviceNorm` runs (``fused-norm`` replaces it)."""
    return F.rms_norm(x, shape, w, eps)


def fused_rms_norm(x: torch.Tensor, shape: tuple[int], w: torch.Tensor, eps: float) -> torch.Tensor:
    """``fused-norm``'s RMSNorm: :class:`CPURMSNorm` for fp32 on a CPU, ``F.rms_norm`` else
    (a device kernel, or low precision, which it computes in fp32)."""
    if x.device.type == "cpu" and x.dtype == w.dtype == torch.float32:
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return CPURMSNorm.apply(x, w, eps)
        return torch.mul(x, _inverse_rms(x, eps)).mul_(w)  # no autograd node to build
    return F.rms_norm(x, shape, w, eps)


def _inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dimension, from one pass over ``x``."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_()


class CPURMSNorm(torch.autograd.Function):
    """RMSNorm over the last dimension with a hand-written backward.

    On a CPU torch 2.13's ``rms_norm`` is a chain of composite ops whose autograd backward
    took 32 ms for one [1024, 4, 512] fp32 tensor on one thread; this one makes six passes
    over the tensor (about 1.3 ms each): ``dx = r * (g - y * mean(g * y))`` with ``g = dy * w``,
    ``y = x * r`` and ``r = 1 / sqrt(mean(x^2) + eps)``; ``dw = sum(dy * y)``. It saves ``x``
    and ``r`` (one value per row), as ``F.rms_norm`` does.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        r = _inverse_rms(x, eps)
        ctx.save_for_backward(x, w, r)
        return torch.mul(x, r).mul_(w)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, r = ctx.saved_tensors
        h = x.shape[-1]
        y = torch.mul(x, r)
        dw = torch.mul(dy, y).reshape(-1, h).sum(0) if ctx.needs_input_grad[1] else None
        g = torch.mul(dy, w)
        mean = torch.linalg.vecdot(g, y, dim=-1).unsqueeze(-1).div_(h)
        dx = torch.addcmul(g, y, mean, value=-1).mul_(r)
        return dx, dw, None


class DeviceNorm(torch.nn.Module):
    """Drop-in for ``WrappedTorchNorm`` (same constructor, same state-dict keys)."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> None:
        super().__init__()
        kind = getattr(config, "normalization", normalization)
        if kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization {kind}: only LayerNorm and RMSNorm are supported")
        self.kind = kind
        self.eps = eps
        self.hidden_size = hidden_size
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        dtype = getattr(config, "params_dtype", torch.float32)
        init = 0.0 if self.zero_centered_gamma else 1.0
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), init, dtype=dtype))
        if kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        sp = bool(getattr(config, "sequence_parallel", False))
        for p in self.parameters():
            p.sequence_parallel = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight + 1 if self.zero_centered_gamma else self.weight
        shape = (self.hidden_size,)
        if self.kind == "RMSNorm":
            return rms_norm(x, shape, w, self.eps)
        return F.layer_norm(x, shape, w, self.bias, self.eps)
