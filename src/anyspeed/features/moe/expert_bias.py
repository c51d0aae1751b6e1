"""MoE experts with biases (GPT-OSS) on Megatron-Core 0.16.1.

An expert's ``MLP.forward`` gets the routing probabilities as ``per_token_scale`` and adds its
fc2 bias, scaled, *in place* on fc2's output. Without expert parallelism that output is the
tensor-parallel reduce's input returned as it is (an autograd custom-function view), so autograd
refuses the in-place add: expert biases cannot train. Here such a call runs the MLP unscaled and
scales the biased output: prob x (W2 act + b), the same value (rounding aside) out of place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def scale_after(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``MLP.forward`` whose biased, probability-scaled path adds the bias out of place."""

    def mlp_forward(
        self: Any, hidden_states: torch.Tensor, per_token_scale: Any = None, **kwargs: Any
    ) -> tuple[torch.Tensor, Any]:
        if per_token_scale is None or not self.config.add_bias_linear:
            return forward(self, hidden_states, per_token_scale, **kwargs)
        output, bias = forward(self, hidden_states, None, **kwargs)
        if bias is not None:
            output = output + bias
        scaled = output * per_token_scale.unsqueeze(-1)
        return scaled.to(output.dtype), None

    mlp_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    return mlp_forward
