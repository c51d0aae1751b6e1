"""LayerNorm / RMSNorm for Megatron's local spec that also works with sequence parallelism.

Megatron's ``WrappedTorchNorm`` (used when neither Transformer Engine nor apex is installed)
refuses ``--sequence-parallel``: with the sequence split across tensor-parallel ranks each rank
sees only part of the tokens, so the norm weights' gradients are partial and must be summed over
the TP group. This module marks its parameters ``sequence_parallel`` so Megatron's
``finalize_model_grads`` does that all-reduce, exactly as it does for Transformer Engine's norms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
            return F.rms_norm(x, shape, w, self.eps)
        return F.layer_norm(x, shape, w, self.bias, self.eps)
