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

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, shape: tuple[int], w: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm :class:`DeviceNorm` runs (``fused-norm`` replaces it)."""
    return F.rms_norm(x, shape, w, eps)


def fused_rms_norm(x: torch.Tensor, shape: tuple[int], w: torch.Tensor, eps: float) -> torch.Tensor:
    """``fused-norm``'s RMSNorm: on a CPU in fp32 under ``torch.inference_mode`` (generation,
    scoring) three passes over ``x``; else ``F.rms_norm``.

    torch 2.13's CPU ``rms_norm`` is a chain of composite ops (square, mean, add, rsqrt, two
    products): 3.2 ms for a [1024, 4, 512] fp32 tensor on one thread against 1.6 ms here. Not
    under plain no-grad: recomputation's no-grad pass must round as its grad pass will. Not
    with grad: a hand-written backward saved one activation less per norm than the composite,
    which ``anyspeed memory``'s count (and its tests) would have to follow first.
    """
    if torch.is_inference_mode_enabled() and x.device.type == "cpu":
        if x.dtype == w.dtype == torch.float32:
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # one pass
            inverse = norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
            return torch.mul(x, inverse).mul_(w)
    return F.rms_norm(x, shape, w, eps)


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
