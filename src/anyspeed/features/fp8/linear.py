"""Megatron's tensor-parallel linear layers with their three GEMMs in FP8.

:class:`Fp8Linear` stands where ``linear_with_grad_accumulation_and_async_allreduce`` does
(``ColumnParallelLinear`` / ``RowParallelLinear``'s ``_forward_impl``) and keeps its contract:
sequence-parallel inputs are gathered in the forward and their gradient reduce-scattered, a
column-parallel layer's input gradient is all-reduced. Operands are quantized with one scale per
tensor whose amax is the maximum over the ranks that hold parts of it (the weight's over the
tensor-parallel group, the input's and its gradient's over TP x CP), so every TP and CP layout
quantizes the same numbers (Transformer Engine reduces amaxes over its group likewise). The input
is saved for the backward in FP8 (one byte per element), the weight is quantized again there
(no FP8 copy is held between the passes), and sequence-parallel shards are gathered in FP8.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from anyspeed.features.fp8.numerics import (
    Scales,
    dtype_of,
    fp8_tensor_cores,
    mm,
    operand,
    quantize,
)
from anyspeed.features.fp8.settings import Fp8Settings


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x``'s shards along dim 0 from every rank of ``group`` (FP8 travels as bytes)."""
    from megatron.core.tensor_parallel import mappings

    if x.dtype.itemsize == 1 and x.is_floating_point():
        return mappings._gather_along_first_dim(x.view(torch.uint8), group).view(x.dtype)
    return mappings._gather_along_first_dim(x, group)


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    from megatron.core.tensor_parallel import mappings

    return mappings._reduce_scatter_along_first_dim(x, group)


class Fp8Linear(torch.autograd.Function):
    """``y = x W^T + b`` with x, W and dy quantized per tensor (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scales: Scales,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        allreduce_dgrad: bool,
        tokens_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        settings, tokens_group = scales.settings, tokens_group or group
        s_x, s_w = scales("input", x, tokens_group), scales("weight", weight, group)
        x_q = quantize(x, dtype_of(settings, "input"), s_x)
        w_q = quantize(weight, dtype_of(settings, "weight"), s_w)
        total = _gather(x_q, group) if sequence_parallel else x_q
        k, n = weight.shape[1], weight.shape[0]
        out = mm(total.reshape(-1, k), s_x, w_q, s_w, x.dtype).view(*total.shape[:-1], n)
        if bias is not None:
            out = out + bias
        keep = x_q if settings.wgrad else x.detach()
        # the weight itself (no extra bytes): quantized again in the backward, with its scale
        ctx.save_for_backward(keep, weight, s_x, s_w)
        ctx.scales, ctx.group, ctx.has_bias = scales, group, bias is not None
        ctx.tokens_group = tokens_group
        ctx.sequence_parallel, ctx.allreduce_dgrad = sequence_parallel, allreduce_dgrad
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        keep, weight, s_x, s_w = ctx.saved_tensors
        settings, group = ctx.scales.settings, ctx.group
        n, k = weight.shape
        w_q = quantize(weight, dtype_of(settings, "weight"), s_w)
        s_g = ctx.scales("grad", grad, ctx.tokens_group)
        g_q = operand(quantize(grad, dtype_of(settings, "grad"), s_g).reshape(-1, n), grad.dtype)
        dx = mm(g_q, s_g, w_q.t(), s_w, grad.dtype).view(*grad.shape[:-1], k)
        if ctx.sequence_parallel:
            dx = _reduce_scatter(dx, group)
        elif ctx.allreduce_dgrad and group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(dx, group=group)
        dw = db = None
        if ctx.needs_input_grad[1]:
            total = _gather(keep, group) if ctx.sequence_parallel else keep
            if settings.wgrad:
                dw = mm(g_q.t(), s_g, total.reshape(-1, k).t(), s_x, grad.dtype)
            else:
                dw = grad.reshape(-1, n).t() @ total.reshape(-1, k).to(grad.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.reshape(-1, n).sum(0)
        return dx, dw, db, None, None, None, None, None


def _tokens_group(linear: torch.nn.Module) -> dist.ProcessGroup | None:
    """The group whose ranks hold parts of one micro-batch's tokens for ``linear``: TP x CP
    (context parallelism splits the sequence), the expert-TP group for an expert's linear."""
    from megatron.core import parallel_state as ps

    if getattr(linear, "is_expert", False) or ps.get_context_parallel_world_size() == 1:
        return linear.tp_group
    return ps.get_tensor_and_context_parallel_group()


def install(linear: torch.nn.Module, settings: Fp8Settings) -> None:
    """Run ``linear``'s (a Column/RowParallelLinear) GEMMs in FP8 with scales of its own."""
    scales, group, tokens = Scales(settings), linear.tp_group, _tokens_group(linear)

    def fp8_forward_impl(
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        # the weight's gradient goes back as .grad; Megatron's DDP hook adds it to main_grad
        return Fp8Linear.apply(
            input, weight, bias, scales, group, sequence_parallel, allreduce_dgrad, tokens
        )

    linear._forward_impl = fp8_forward_impl
    linear.fp8_scales = scales


def install_block(block: torch.nn.Module, settings: Fp8Settings) -> int:
    """FP8 GEMMs in every linear layer of ``block``'s (a TransformerBlock) layers, but the
    ``--first-last-layers-bf16`` ones; the number of layers changed."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    total, changed = block.config.num_layers, 0
    for layer in getattr(block, "layers", []):
        if not settings.in_fp8(layer.layer_number - 1, total):
            continue
        for module in layer.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                install(module, settings)
        changed += 1
    return changed


def describe(prog: str, chunks: list[torch.nn.Module], settings: Fp8Settings) -> str:
    """The start-up line of an FP8 run: its format and recipe, how many of this rank's linear
    layers run FP8 GEMMs, and whether they are tensor-core GEMMs or an emulation."""
    linears = [m for c in chunks for m in c.modules() if hasattr(m, "fp8_scales")]
    weight = next((m.weight for m in linears if getattr(m, "weight", None) is not None), None)
    device = weight.device if weight is not None else torch.device("cpu")
    if device.type == "cuda" and fp8_tensor_cores(device.index or 0):
        how = "torch._scaled_mm on FP8 tensor cores"
    else:
        how = f"emulated on {device.type} (exact FP8 numerics, not FP8 speed)"
    return (
        f"{prog}: FP8 GEMMs ({settings.format}, {settings.recipe} scaling) in "
        f"{len(linears)} linear layers on rank 0: {how}"
    )
