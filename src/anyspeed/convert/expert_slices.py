"""Expert tensors stored stacked in Hugging Face checkpoints (GPT-OSS): one [experts, ...]
tensor per layer and kind, fc1's gate and up columns interleaved (gate at even, up at odd
positions) and the matrices stored input-major. Megatron keeps one [2f, h] fc1 ([gate; up]),
[2f] bias, [h, f] fc2 and [h] bias per expert; these turn one expert's slice into Megatron's
tensor and back, exactly (copies and transposes only)."""

from __future__ import annotations

import torch


def slice_to_megatron(layout: str, t: torch.Tensor) -> torch.Tensor:
    """Megatron's tensor from one expert's HF slice ``t``."""
    if layout == "gate_up_t":  # [h, 2f] interleaved columns -> [gate; up] rows, [2f, h]
        return torch.cat([t[:, 0::2].t(), t[:, 1::2].t()]).contiguous()
    if layout == "gate_up":  # [2f] interleaved -> [gate; up]
        return torch.cat([t[0::2], t[1::2]])
    if layout == "t":
        return t.t().contiguous()
    if layout == "same":
        return t.contiguous()
    raise ValueError(f"unknown expert slice layout {layout!r}")


def slice_to_hf(layout: str, t: torch.Tensor) -> torch.Tensor:
    """One expert's HF slice from Megatron's tensor ``t`` (the inverse of the above)."""
    if layout in ("gate_up_t", "gate_up"):
        gate, up = t.chunk(2, dim=0)
        if layout == "gate_up_t":
            gate, up = gate.t(), up.t()
        out = t.new_empty(*gate.shape[:-1], 2 * gate.shape[-1])
        out[..., 0::2] = gate
        out[..., 1::2] = up
        return out
    if layout == "t":
        return t.t().contiguous()
    if layout == "same":
        return t.contiguous()
    raise ValueError(f"unknown expert slice layout {layout!r}")


def hf_slice_shape(layout: str, megatron_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one expert's HF slice for a Megatron tensor of ``megatron_shape``."""
    return tuple(reversed(megatron_shape)) if layout in ("gate_up_t", "t") else megatron_shape
