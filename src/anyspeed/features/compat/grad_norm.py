"""The gradient norm Megatron clips with, exact to fp32 rounding on every device.

Without Transformer Engine or apex, Megatron-Core's ``get_grad_norm_fp32`` takes each
gradient's L2 norm with ``megatron.core.utils.local_multi_tensor_l2_norm``, i.e. ``torch.norm``.
On the CPU, torch's fp32 ``vector_norm`` of a whole tensor accumulates without pairwise
summation: its relative error grows with the element count (about 1e-5 at 1M elements, 1e-4 at
4M, 5e-3 at 64M). Gradients sharded over tensor parallelism are smaller, so the norm Megatron
reports and clips with changed with the layout (4e-5 between TP1 and TP2 on a 32k x 128
output layer) while every gradient was equal. :func:`multi_tensor_l2_norm` takes the norm of
rows of :data:`ROW` elements (exact to ~1e-9 each) and sums their squares in fp64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Elements per row whose fp32 norm is taken in one reduction: small enough that torch's
# accumulation error stays near 1e-9, large enough that a 64M-element tensor takes no longer
# than one torch.norm.
ROW = 4096


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """fp64 sum of the squares of ``t``'s elements, from fp32 (or wider) norms of rows."""
    flat = t.detach().reshape(-1)
    acc = flat.dtype if flat.dtype in (torch.float32, torch.float64) else torch.float32
    whole = flat.numel() // ROW * ROW
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    if whole:
        rows = torch.linalg.vector_norm(flat[:whole].view(-1, ROW), dim=1, dtype=acc)
        total = total + rows.double().square().sum()
    if whole < flat.numel():
        rest = torch.linalg.vector_norm(flat[whole:], dtype=acc)
        total = total + rest.double().square()
    return total


def multi_tensor_l2_norm(
    chunk_size: int,
    noop_flag: Any,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    per_tensor: bool,
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in for ``amp_C.multi_tensor_l2norm`` / Megatron's local one: (the L2 norm of all
    tensors of ``tensor_lists`` as a 1-element fp32 tensor, per-tensor norms if asked)."""
    tensors = [t for tl in tensor_lists for t in tl]
    device = tensors[0].device if tensors else torch.device("cpu")
    squares = [sum_of_squares(t).to(device) for t in tensors]
    if not squares:
        return torch.zeros(1, dtype=torch.float32, device=device), None
    stacked = torch.stack(squares)
    total = stacked.sum().sqrt().float().reshape(1)
    return total, (stacked.sqrt().float() if per_tensor else None)
