"""The 3-D rotary positions (temporal, height, width) of Qwen2-VL / Qwen2.5-VL sequences.

Text advances all three axes together, one per token. A vision block (the image or video
pad tokens of one input, ``t * h * w / merge**2`` of them, in the vision tower's output order)
holds its grid: each axis starts where the text before it stopped; height and width count the
merged rows and columns; time counts frames, spaced by ``tokens_per_second * seconds per frame``
for Qwen2.5-VL videos (1 for images and for Qwen2-VL). The text after the block resumes at
``start + max(h, w) / merge``, as transformers 5 computes it. Padding (``attention_mask`` 0) is
skipped and gets position 0. ``deltas`` (per row: largest position + 1 - the row's length) turn
a decoding step's 1-D cache position into its 3-D one: the same ``cache_position + delta`` on
every axis.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionTokens:
    """What marks and shapes the vision blocks of a sequence."""

    image_token_id: int
    video_token_id: int
    spatial_merge_size: int = 2
    tokens_per_second: float | None = None  # Qwen2.5-VL's video time scale; None: Qwen2-VL


def _runs(kinds: list[int]) -> Iterator[tuple[int, int]]:
    """(kind, length) of each run of equal token kinds, in order."""
    start = 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            yield kinds[start], i - start
            start = i


def _block(
    start: int, grid: Sequence[int], merge: int, interval: float
) -> tuple[torch.Tensor, int]:
    """One vision block's positions [3, t*h*w] from ``start``, and where text resumes."""
    t, h, w = (int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge)
    frames = (torch.arange(t) * interval).long() + start
    rows, cols = torch.arange(h) + start, torch.arange(w) + start
    tt, hh, ww = torch.meshgrid(frames, rows, cols, indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1), start + max(h, w)


def _row(
    ids: torch.Tensor, spec: VisionTokens, grids: dict[int, Iterator], seconds: Iterator
) -> torch.Tensor:
    """The positions [3, n] of one row's (unpadded) tokens."""
    kinds = [
        1 if x == spec.image_token_id else 2 if x == spec.video_token_id else 0
        for x in ids.tolist()
    ]
    pieces, pos = [], 0
    for kind, length in _runs(kinds):
        if kind == 0:
            pieces.append(torch.arange(length).expand(3, -1) + pos)
            pos += length
            continue
        grid = next(grids[kind], None)
        if grid is None:
            raise ValueError(f"more {'image' if kind == 1 else 'video'} blocks than grids given")
        interval = 1.0
        if kind == 2 and spec.tokens_per_second is not None:
            interval = spec.tokens_per_second * float(next(seconds))
        block, pos = _block(pos, grid, spec.spatial_merge_size, interval)
        if block.shape[1] != length:
            what = "image" if kind == 1 else "video"
            raise ValueError(
                f"{length} {what} pad tokens in a row for an {what} of {block.shape[1]} "
                "features: a block must hold t*h*w / merge**2 tokens of its grid"
            )
        pieces.append(block)
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)


def mrope_positions(
    input_ids: torch.Tensor,
    spec: VisionTokens,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [3, b, s] and decoding deltas [b, 1] of a batch; the grids are the images'
    and videos' (t, h, w) patch grids in order of appearance across the batch."""
    b, s = input_ids.shape
    positions = torch.zeros(3, b, s, dtype=torch.long)
    grids = {
        1: iter([] if image_grid_thw is None else image_grid_thw.tolist()),
        2: iter([] if video_grid_thw is None else video_grid_thw.tolist()),
    }
    seconds = iter([1.0] * s if second_per_grid_ts is None else second_per_grid_ts.tolist())
    deltas = []
    for i in range(b):
        keep = (
            torch.ones(s, dtype=torch.bool) if attention_mask is None else attention_mask[i].bool()
        )
        row = _row(input_ids[i][keep], spec, grids, seconds)
        positions[:, i, keep] = row
        deltas.append((int(row.max()) + 1 if row.numel() else 0) - int(keep.sum()))
    return positions.to(input_ids.device), torch.tensor(deltas).unsqueeze(1).to(input_ids.device)
