"""Hybrid decoders: gated DeltaNet (linear attention) layers between full-attention ones.

Qwen3-Next puts a gated DeltaNet in three of every four layers. Megatron-Core 0.16.1 has the
layer (``megatron.core.ssm.gated_delta_net.GatedDeltaNet``) but builds hybrid blocks only from
Transformer Engine modules; here the block is the local spec's, with the DeltaNet's projections
as Megatron's own tensor-parallel linears. The kernel is anyspeed's plain-PyTorch gated delta
rule (feature ``delta-net-compat``), so the layer runs on every device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from anyspeed.models.config import ModelConfig


class DeltaNetOutputNorm(torch.nn.Module):
    """The DeltaNet's per-head output RMSNorm (plain ``x * w``, weight 1 at start, unlike the
    model's zero-centred norms). Its weight is whole on every TP rank while each rank holds
    other heads, so its gradient is summed over the TP group in the backward (Megatron's
    finalize step sums only the q/k norms' and sequence-parallel weights')."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.tp = getattr(config, "tensor_model_parallel_size", 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.tp > 1:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            w = copy_to_tensor_model_parallel_region(w)  # identity; grads summed over TP
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return w * normed


def delta_net_spec():
    """The gated DeltaNet of one layer, from Megatron's local (non-TE) modules."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=DeltaNetOutputNorm, out_proj=RowParallelLinear
        ),
    )


def with_linear_attention(model: ModelConfig, config: Any, spec: Any, vp_stage: int | None):
    """``spec`` (one layer's spec, or a block spec of this stage) as the block spec of this
    pipeline stage in which the layers ``model.linear_attention_layers()`` names are gated
    DeltaNets."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if isinstance(spec, TransformerBlockSubmodules):
        layers, norm = list(spec.layer_specs), spec.layer_norm
    else:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        layers = [spec] * get_num_layers_to_build(config, vp_stage=vp_stage)
        norm = WrappedTorchNorm
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    linear = model.linear_attention_layers()
    delta = delta_net_spec()
    out = []
    for i, layer in enumerate(layers):
        if linear[offset + i]:
            sub = dataclasses.replace(layer.submodules, self_attention=delta)
            layer = dataclasses.replace(layer, submodules=sub)
        out.append(layer)
    return TransformerBlockSubmodules(layer_specs=out, layer_norm=norm)


def linear_attention_config(model: ModelConfig) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of ``model``'s gated DeltaNet layers (none without)."""
    if model.experimental_attention_variant != "gated_delta_net":
        return {}
    freq = model.linear_attention_freq
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(x) for x in model.linear_attention_layers()]
        if not str(freq).isdigit()
        else int(str(freq)),
        linear_conv_kernel_dim=model.linear_conv_kernel_dim,
        linear_key_head_dim=model.linear_key_head_dim,
        linear_value_head_dim=model.linear_value_head_dim,
        linear_num_key_heads=model.linear_num_key_heads,
        linear_num_value_heads=model.linear_num_value_heads,
    )
