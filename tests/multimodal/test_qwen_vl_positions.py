"""Qwen2-VL / Qwen2.5-VL 3-D rotary positions against transformers' own ``get_rope_index``:
two images of different sizes, a 4-frame video with its seconds per frame, a left-padded
text-only row; positions and decoding deltas exact."""

from __future__ import annotations

import pytest
import torch

from anyspeed.models.qwen_vl.positions import VisionTokens, mrope_positions
from helpers.qwen_vl import END, IMAGE, START, VIDEO, hf_config, seconds_per_grid

IMAGES = torch.tensor([[1, 8, 10], [1, 4, 4]])  # 16x20 and 8x8 px at patch 2
VIDEOS = torch.tensor([[2, 4, 4]])  # 4 frames (temporal patch 2) of 8x8 px


def _model(kind: str):
    import transformers

    cls = transformers.Qwen2VLModel if kind == "qwen2_vl" else transformers.Qwen2_5_VLModel
    return cls(hf_config(kind)).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Row 0: text, two images, text; row 1: text, a video, text; row 2: left-padded text."""
    rows = [
        [5, 6, START, *[IMAGE] * 20, END, 7, START, *[IMAGE] * 4, END, 8, 9],
        [10, START, *[VIDEO] * 8, END, 11, 12, 13],
        [14, 15, 16, 17],
    ]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_positions_equal_get_rope_index(kind: str) -> None:
    model = _model(kind)
    ids, mask = _batch()
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    seconds = seconds_per_grid()
    extra = {"second_per_grid_ts": torch.tensor([seconds])} if kind == "qwen2_5_vl" else {}
    want, want_deltas = model.get_rope_index(ids, types, IMAGES, VIDEOS, attention_mask=mask,
                                             **extra)  # fmt: skip
    spec = VisionTokens(IMAGE, VIDEO, 2, 4 if kind == "qwen2_5_vl" else None)
    got, deltas = mrope_positions(ids, spec, IMAGES, VIDEOS, attention_mask=mask, **extra)
    assert torch.equal(got, want)
    assert torch.equal(deltas, want_deltas)
    frames = got[0, 1][ids[1] == VIDEO].unique()  # the inputs exercise the time spacing
    assert (frames[1] - frames[0]).item() == (int(seconds * 4) if kind == "qwen2_5_vl" else 1)


def test_a_block_that_does_not_fit_its_grid_is_refused() -> None:
    ids = torch.tensor([[5, START, *[IMAGE] * 3, END]])
    with pytest.raises(ValueError, match="3 image pad tokens in a row for an image of 20 features"):
        mrope_positions(ids, VisionTokens(IMAGE, VIDEO), IMAGES[:1])
    with pytest.raises(ValueError, match="more image blocks than grids"):
        mrope_positions(ids, VisionTokens(IMAGE, VIDEO))
