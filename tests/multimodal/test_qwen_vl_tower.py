"""The Qwen2-VL / Qwen2.5-VL vision tower on Megatron-Core layers against transformers'
``model.visual``: two images whose sizes leave partial windows and a 4-frame video in one call,
fp32, output within 1e-5; its tensors convert back to HF's bit-identical."""

from __future__ import annotations

import pytest
import torch

from anyspeed.convert.megatron_io import megatron_session
from anyspeed.convert.qwen_vl import tower_to_hf, tower_to_megatron
from anyspeed.models.qwen_vl.tower import (
    QwenVisionTower,
    tower_from_hf,
    tower_transformer_config,
)
from helpers.qwen_vl import hf_config

GRIDS = torch.tensor([[1, 8, 10], [1, 4, 4], [2, 4, 4]])  # 16x20 px, 8x8 px, 4 frames of 8x8


def _hf(kind: str, **text: object):
    import transformers

    vision = {"depth": 2}
    if kind == "qwen2_5_vl":  # 4x4-patch windows: the 8x10 image leaves partial ones
        vision.update(window_size=8, fullatt_block_indexes=[1])
    cls = transformers.Qwen2VLForConditionalGeneration
    if kind == "qwen2_5_vl":
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    model = cls(hf_config(kind, vision_extra=vision, **text)).eval()
    with torch.no_grad():  # norms away from 1, biases away from 0: a misplaced one shows
        for name, p in model.model.visual.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_tower_equals_transformers_and_converts_back_exactly(kind: str) -> None:
    hf = _hf(kind)
    cfg = tower_from_hf(hf.config.vision_config.to_dict())
    assert cfg.windowed == (kind == "qwen2_5_vl")
    visual = hf.model.visual
    sd = visual.state_dict()
    pixels = torch.randn(int(GRIDS.prod(-1).sum()), cfg.patch_dim)
    with megatron_session():
        tower = QwenVisionTower(cfg, tower_transformer_config(cfg)).eval()
        state = tower_to_megatron(cfg, lambda n: sd[n])
        missing, unexpected = tower.load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
        with torch.no_grad():
            got = tower(pixels, GRIDS)
            want = visual(pixels, grid_thw=GRIDS).pooler_output
    assert got.shape == want.shape == (int(GRIDS.prod(-1).sum()) // 4, 64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    back = tower_to_hf(cfg, {k: v for k, v in tower.state_dict().items()
                             if not k.endswith("_extra_state") and k != "inv_freq"})  # fmt: skip
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_images_never_see_each_other() -> None:
    """Changing the second image leaves the first image's tokens as they were."""
    hf = _hf("qwen2_5_vl")
    cfg = tower_from_hf(hf.config.vision_config.to_dict())
    sd = hf.model.visual.state_dict()
    pixels = torch.randn(int(GRIDS.prod(-1).sum()), cfg.patch_dim)
    other = pixels.clone()
    other[80:] += 1.0  # the second image and the video
    with megatron_session():
        tower = QwenVisionTower(cfg, tower_transformer_config(cfg)).eval()
        tower.load_state_dict(tower_to_megatron(cfg, lambda n: sd[n]), strict=False)
        with torch.no_grad():
            a, b = tower(pixels, GRIDS), tower(other, GRIDS)
    torch.testing.assert_close(a[:20], b[:20], rtol=0, atol=0)
    assert (a[20:] - b[20:]).abs().max() > 1e-3
