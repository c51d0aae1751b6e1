"""Part of ``no-grad-fast-path`` on an x86 CPU: the lean decode step multiplies by MKL-packed
copies of a model's fp32 linear weights, packed once per batch size.

A decode step is a chain of products whose left side has one row per sequence. Each plain
``x @ w.t()`` re-packs ``w`` into MKL's blocked layout inside the call: for a few rows that
re-layout costs as much as the multiplication. A weight packed once for the batch's row count
skips it: 1.3x-1.6x faster products at 2-64 rows over SmolLM2-135M's weights, the same sums
(bit-equal at 64 rows). One row keeps the plain product (and the weights' transposed order,
:mod:`anyspeed.features.inference.weights`). See docs/inference.md.

The packed copies double the weights' memory while the model decodes, so packing is switched
on only for a model loaded to generate or score, or for one rollout of a model being trained
(the copies freed after it), whose weights take under a quarter of the memory then available;
one batch size is kept at a time, and a weight changed in place since it was packed (its
version counter moved) or given new data is packed again.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_KEY = "_anyspeed_packed_weights"
_SHARE = 4  # pack only when the weights take under 1/_SHARE of the available memory
# one row streams each weight once: packing measured ~5% slower end to end there (SmolLM2's
# shape, one thread), while 2-64 rows gain 1.3x-1.6x in the products
MIN_ROWS = 2


def available() -> bool:
    """Whether this torch has MKL's packed fp32 product (x86 builds)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedWeights:
    """Packed copies of one model's weights for the current row count."""

    def __init__(self) -> None:
        self.rows = 0
        self._packs: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """``x @ w.t() + b`` through ``w``'s packed copy for ``x``'s row count."""
        rows = x.numel() // x.shape[-1]
        if rows < MIN_ROWS:
            out = torch.matmul(x, w.t())
            return out if b is None else out + b
        if rows != self.rows:  # another batch size: drop the old copies first
            self._packs.clear()
            self.rows = rows
        stamp = (w._version, w.data_ptr())  # changed in place, or new data assigned
        held = self._packs.get(id(w))
        if held is None or held[0] != stamp:
            held = (stamp, torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), rows))
            self._packs[id(w)] = held
        flat = x.reshape(rows, x.shape[-1])
        return torch.ops.mkl._mkl_linear(flat, held[1], w, b, rows).view(*x.shape[:-1], -1)


def of(model: Any) -> PackedWeights | None:
    """The model's packed weights, when :func:`enable` switched them on."""
    return model.__dict__.get(_KEY)


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):  # not known here: do not pack
        return 0


def enable(chunks: list[Any], weights: list[torch.Tensor]) -> bool:
    """Switch packed products on for ``chunks`` (fp32 ``weights`` of the lean step's plain
    layers) when MKL has them and the copies fit; whether it did."""
    if not available() or any(w.dtype != torch.float32 or w.device.type != "cpu" for w in weights):
        return False
    if any(w.is_inference() for w in weights):  # no version counter to see a change by
        return False
    if sum(w.numel() * 4 for w in weights) * _SHARE > _available_bytes():
        return False
    for chunk in chunks:
        chunk.__dict__[_KEY] = PackedWeights()
    return True


def disable(chunks: list[Any]) -> None:
    """Drop ``chunks``' packed copies: the lean step multiplies by the weights again."""
    for chunk in chunks:
        chunk.__dict__.pop(_KEY, None)
