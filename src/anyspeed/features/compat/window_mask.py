"""Level-0 feature ``window-padding-mask``: Megatron's sliding-window softmax keeps the mask
it is given.

Megatron-Core 0.16.1's ``FusedScaleMaskSoftmax.forward_torch_softmax`` builds the sliding-window
mask of a windowed layer *in place of* the mask passed in, so a left-padded batch's padding
slots are attended: in generation (a decode step's query over the cache) the shorter prompts of
a batch got other tokens than alone (measured on a 3-key window, GPT-OSS's, Gemma's and Phi-3's
layers). Here the window is added to the given mask; without a mask (training's causal case)
nothing changes.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature
from anyspeed.patching import PatchManager

TARGET = "megatron.core.fusions.fused_softmax.FusedScaleMaskSoftmax.forward_torch_softmax"


def outside_window(sq: int, sk: int, window: tuple[int, int], device: Any) -> torch.Tensor:
    """[sq, sk] True where key j lies outside query i's window (the last ``sq`` of ``sk``
    positions: ``i - left <= j <= i + right``), as Megatron's sliding-window mask."""
    rows = torch.arange(sk - sq, sk, device=device)[:, None]
    cols = torch.arange(sk, device=device)[None, :]
    return (cols < rows - window[0]) | (cols > rows + window[1])


def keeping_the_mask(forward: Any) -> Any:
    """``forward_torch_softmax`` that masks what the window hides *and* what ``mask`` hides."""

    @functools.wraps(forward)
    def forward_with_mask(self: Any, input: torch.Tensor, mask: Any, *args: Any, **kw: Any):
        window = self.window_size
        if window is None or mask is None:
            return forward(self, input, mask, *args, **kw)
        hidden = mask | outside_window(input.size(2), input.size(3), window, input.device)
        self.window_size = None  # (its own mask would replace the combined one)
        try:
            return forward(self, input, hidden, *args, **kw)
        finally:
            self.window_size = window

    return forward_with_mask


class WindowPaddingMask(Feature):
    name = "window-padding-mask"
    level = 0
    description = "Megatron's sliding-window softmax keeps the padding mask it is given"

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        pm.register_wrap(
            TARGET,
            keeping_the_mask,
            feature=self.name,
            reason="a windowed layer's softmax built its window mask in place of the given one: "
            "left-padded generation attended the padding",
        )
