"""Qwen-VL pixels through transformers' ``Qwen2VLImageProcessor`` (its smart resize, rescale,
normalisation and merge-block patch order): images as the processor lays them out, and videos
from their frames.

A video frame pair is exactly what the processor makes of two images of one size, each tiled to
two frames: a patch row is ``C x T x P x P``, so the pair's row takes the first image's ``T = 0``
half and the second's ``T = 1`` half. Frames are read as decoded image files.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

# transformers' defaults (Qwen2-VL's processor): 56^2 to 28^2 * 1280 pixels
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """transformers' ``smart_resize``: (height, width), multiples of ``factor``, aspect kept,
    pixels within [min_pixels, max_pixels]; ValueError past an aspect ratio of 200."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as f
    except ImportError:  # transformers 4.x keeps it beside the processor
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as f
    return f(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def processor_settings(hf_dir: str | None, patch: int, merge: int, temporal: int) -> dict:
    """The image processor's settings: the HF directory's ``preprocessor_config.json`` where
    it has one (either spelling of the pixel bounds), else transformers' defaults."""
    saved: dict[str, Any] = {}
    path = os.path.join(hf_dir, "preprocessor_config.json") if hf_dir else ""
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    size = saved.get("size") or {}
    out = {
        "patch_size": patch,
        "merge_size": merge,
        "temporal_patch_size": temporal,
        "min_pixels": int(saved.get("min_pixels") or size.get("shortest_edge") or MIN_PIXELS),
        "max_pixels": int(saved.get("max_pixels") or size.get("longest_edge") or MAX_PIXELS),
    }
    for key in ("image_mean", "image_std"):
        if saved.get(key):
            out[key] = list(saved[key])
    return out


class Pixels:
    """Decoded inputs -> (pixel rows, grids) of the tower."""

    def __init__(self, settings: dict) -> None:
        import transformers

        # transformers 5's PIL processor (its default one needs torchvision); 4.x has only one
        cls = getattr(transformers, "Qwen2VLImageProcessorPil", None)
        self.settings = settings
        self.processor = (cls or transformers.Qwen2VLImageProcessor)(**settings)

    def _process(self, paths: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        images = []
        for p in paths:
            with Image.open(p) as im:
                images.append(im.convert("RGB"))
        out = self.processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def images(self, paths: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixel rows [patches, C*T*P*P] and grids [n, 3] of ``paths`` in order."""
        return self._process(paths)

    def video(self, frames: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """One video's pixel rows and grid [1, 3]: frame pairs in order (an odd last frame is
        repeated, as the processor does)."""
        temporal = self.settings["temporal_patch_size"]
        frames = list(frames) + [frames[-1]] * (-len(frames) % temporal)
        rows, grids = self._process(frames)
        _, h, w = (int(x) for x in grids[0])
        per_frame = rows.view(len(frames), h * w, -1, temporal, rows.shape[-1] // temporal // 3)
        # [frame, patch, C, T, P*P]: frame k of each group supplies the group's T = k slice
        groups = per_frame.view(-1, temporal, *per_frame.shape[1:])
        picked = torch.stack([groups[:, k, :, :, k] for k in range(temporal)], dim=3)
        video = picked.reshape(-1, rows.shape[-1])
        grid = torch.tensor([[len(frames) // temporal, h, w]])
        return video, grid
