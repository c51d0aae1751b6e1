"""Recompute of the MLP activation and of the norms, per transformer layer.

* Activation: the MLP keeps its fc1 output (the activation's own input) for backward but not
  the activation's output, which ``linear_fc2`` would otherwise keep; the output's storage is
  released after fc2 and refilled just before fc2's backward (Megatron's
  ``CheckpointWithoutOutput``). The activation itself is Megatron's own ``MLP.forward`` run on
  a stand-in whose linears are the identity, so every branch (fused level-1 SwiGLU, GeLU, GLU,
  expert probability scaling) is computed by the same code as without recompute.
* Norms: Megatron's transformer layer already knows how to recompute its input and pre-MLP
  norms (the ``layernorm`` selective-recompute module); here it is switched on per layer.

A layer qualifies when its number within its model chunk is <= the ``-num-layers`` flag (all
layers when the flag is absent), as MindSpeed counts them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

_MARK = "_anyspeed_recompute_activation"


class _ActivationOnly:
    """An MLP whose linears are the identity (fc1 returns the given bias): Megatron's
    ``MLP.forward`` on it computes only the activation of an fc1 output."""

    def __init__(self, mlp: torch.nn.Module, bias: torch.Tensor | None) -> None:
        self._mlp, self._bias = mlp, bias

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mlp, name)

    def linear_fc1(self, x: torch.Tensor):
        return x, self._bias

    def linear_fc2(self, x: torch.Tensor):
        return x, None


def wrap_mlp_forward(forward: Callable) -> Callable:
    """``MLP.forward`` that discards the activation output of marked MLPs after fc2."""

    @functools.wraps(forward)
    def mlp_forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not getattr(self, _MARK, False) or self.config.use_te_activation_func:
            return forward(self, hidden_states, per_token_scale, **kwargs)
        from megatron.core.tensor_parallel import CheckpointWithoutOutput

        def activation(x, bias, scale):
            return forward(_ActivationOnly(self, bias), x, scale, **kwargs)[0]

        fc1_out, fc1_bias = self.linear_fc1(hidden_states)
        ckpt = CheckpointWithoutOutput()
        act = ckpt.checkpoint(activation, fc1_out, fc1_bias, per_token_scale)
        out, out_bias = self.linear_fc2(act)
        ckpt.discard_output_and_register_recompute(out)
        if per_token_scale is not None and out_bias is not None:  # an expert: bias scaled
            out = out + out_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
            out_bias = None
        return out, out_bias

    return mlp_forward


def _selected(layer_number: int, num_layers: int | None) -> bool:
    return num_layers is None or layer_number <= num_layers


def mark_activation(layer: torch.nn.Module, layer_number: int, num_layers: int | None) -> None:
    """Switch activation recompute on for the dense MLP or the experts of ``layer``."""
    if not _selected(layer_number, num_layers):
        return
    from megatron.core.transformer.mlp import MLP

    for module in layer.mlp.modules():
        if isinstance(module, MLP):  # dense MLP, sequential experts, shared experts
            setattr(module, _MARK, True)
        elif hasattr(module, "activation_recompute"):  # GroupedMLP: Megatron's own switch
            module.activation_recompute = True


def mark_norms(layer: torch.nn.Module, layer_number: int, num_layers: int | None) -> None:
    """Switch Megatron's input / pre-MLP norm recompute on for ``layer``."""
    if not _selected(layer_number, num_layers):
        return
    from megatron.core.transformer.identity_op import IdentityOp

    if not isinstance(layer.input_layernorm, IdentityOp):
        layer.recompute_input_layernorm = True
    if not isinstance(layer.pre_mlp_layernorm, IdentityOp):
        layer.recompute_pre_mlp_layernorm = True


def wrap_layer_init(marks: list[tuple[Callable, int | None]]) -> Callable:
    """A wrapper of ``TransformerLayer.__init__`` that applies each ``(mark, num_layers)``
    to the new layer with its number within the model chunk (1-based)."""

    def wrap(init: Callable) -> Callable:
        @functools.wraps(init)
        def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
            init(self, config, submodules, layer_number, *args, **kwargs)
            for mark, num_layers in marks:
                mark(self, layer_number, num_layers)

        return __init__

    return wrap
