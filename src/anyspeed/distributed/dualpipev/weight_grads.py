"""Weight gradients of the tensor-parallel linears, computed later (DualPipeV's "W" steps).

A zero-bubble schedule splits a backward into B (input gradients, which the previous stage
waits for) and W (weight gradients, which nobody waits for) and runs W where the pipeline would
idle. Inside :func:`split_step`, Megatron's ``linear_with_grad_accumulation_and_async_allreduce``
(every ``ColumnParallelLinear`` / ``RowParallelLinear``, experts and the output layer
included) records through :class:`_Linear`: the same products and tensor-parallel
communication, with ``dW = dY^T X`` either done at once or, for a backward run under
:func:`deferred`, queued as one W unit that :func:`run_weight_unit` adds to the weights'
gradient buffers later. Other parameters (norms, embeddings, biases) get theirs in B.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

_STATE: dict[str, Any] = {"split": False, "capture": None}
_UNITS: deque[list[Callable[[], None]]] = deque()


@contextlib.contextmanager
def split_step() -> Iterator[None]:
    """Linears built by Megatron record weight gradients that a backward may defer."""
    _STATE["split"] = True
    try:
        yield
    finally:
        _STATE["split"] = False
        if _UNITS:  # a schedule bug, not a user error: the gradients would be lost
            _UNITS.clear()
            raise RuntimeError("DualPipeV left deferred weight gradients unapplied")


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """The weight gradients of a backward run inside the block form one W unit."""
    _STATE["capture"] = []
    try:
        yield
    finally:
        _UNITS.append(_STATE["capture"])
        _STATE["capture"] = None


@torch.no_grad()
def run_weight_unit() -> None:
    """Compute and accumulate the oldest W unit's weight gradients."""
    for compute in _UNITS.popleft():
        compute()


def _accumulate(weight: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` where Megatron's DDP hook would: the main gradient buffer, else ``.grad``."""
    main = getattr(weight, "main_grad", None)
    if main is not None:
        main.add_(grad)
    elif weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad


class _Linear(torch.autograd.Function):
    """Megatron's local linear (input gathered over TP under SP; input gradient all-reduced,
    or reduce-scattered under SP), its weight gradient possibly deferred."""

    @staticmethod
    def forward(  # noqa: ANN205
        ctx,  # noqa: ANN001
        x,  # noqa: ANN001
        weight,  # noqa: ANN001
        bias,  # noqa: ANN001
        allreduce_dgrad,  # noqa: ANN001
        sequence_parallel,  # noqa: ANN001
        group,  # noqa: ANN001
    ):
        ctx.save_for_backward(x, weight)
        # The parameter itself, for its ``main_grad``: under saved-tensor hooks (the bytes
        # meter) ``saved_tensors`` gives back a plain tensor without Megatron's attributes.
        ctx.param = weight
        ctx.flags = (bias is not None, allreduce_dgrad, sequence_parallel, group)
        total = _gathered(x, group) if sequence_parallel else x
        out = torch.matmul(total, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        use_bias, allreduce_dgrad, sequence_parallel, group = ctx.flags
        dx = dy.matmul(weight)
        if sequence_parallel:
            part = torch.empty(x.shape, dtype=dx.dtype, device=dx.device)
            dist.reduce_scatter_tensor(part, dx.contiguous(), group=group)
            dx = part
        elif allreduce_dgrad:
            dist.all_reduce(dx, group=group)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dbias = dy2.sum(dim=0) if use_bias else None

        def weight_grad() -> torch.Tensor:
            total = _gathered(x, group) if sequence_parallel else x
            return dy2.t().matmul(total.reshape(-1, total.shape[-1]))

        capture = _STATE["capture"]
        if capture is None:
            return dx, weight_grad(), dbias, None, None, None
        param = ctx.param
        capture.append(lambda: _accumulate(param, weight_grad()))
        return dx, None, dbias, None, None, None


def _gathered(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` all-gathered along its first (sequence) dimension over ``group``."""
    out = torch.empty((x.shape[0] * group.size(), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def wrap_linear(original: Callable) -> Callable:
    """Megatron's linear, recorded through :class:`_Linear` inside :func:`split_step` (unless
    it fuses gradient accumulation or defers the embedding's weight gradient itself)."""

    @functools.wraps(original)
    def linear_with_grad_accumulation_and_async_allreduce(
        input,  # noqa: A002, ANN001 - Megatron's keyword names
        weight,  # noqa: ANN001
        bias,  # noqa: ANN001
        gradient_accumulation_fusion,  # noqa: ANN001
        allreduce_dgrad,  # noqa: ANN001
        sequence_parallel,  # noqa: ANN001
        grad_output_buffer=None,  # noqa: ANN001
        wgrad_deferral_limit=0,  # noqa: ANN001
        async_grad_allreduce=None,  # noqa: ANN001
        tp_group=None,  # noqa: ANN001
    ):
        own = (
            _STATE["split"]
            and not gradient_accumulation_fusion
            and grad_output_buffer is None
            and torch.is_grad_enabled()
        )
        if not own:
            return original(
                input,
                weight,
                bias,
                gradient_accumulation_fusion,
                allreduce_dgrad,
                sequence_parallel,
                grad_output_buffer,
                wgrad_deferral_limit,
                async_grad_allreduce,
                tp_group,
            )
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        group = get_tensor_model_parallel_group_if_none(tp_group)  # async_grad_allreduce: unused
        return _Linear.apply(input, weight, bias, allreduce_dgrad, sequence_parallel, group)

    return linear_with_grad_accumulation_and_async_allreduce
