"""Qwen2-VL / Qwen2.5-VL on Megatron-Core (tower + mRoPE GPTModel) against transformers'
``*ForConditionalGeneration`` after conversion: a batch with two images of different sizes and a
timed 4-frame video, fp32, logits within 1e-4; more pad tokens than features is one line."""

from __future__ import annotations

import pytest
import torch
from test_qwen_vl_tower import GRIDS, _hf

from anyspeed.convert.megatron_io import megatron_session
from anyspeed.convert.qwen_vl import model_to_megatron
from anyspeed.models import gpt
from anyspeed.models.qwen_vl.model import QwenVLModel
from anyspeed.models.qwen_vl.positions import VisionTokens
from anyspeed.models.qwen_vl.tower import tower_transformer_config
from helpers.qwen_vl import END, IMAGE, START, VIDEO, seconds_per_grid

TEXT = {
    "num_hidden_layers": 2,
    "initializer_range": 0.3,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
}


def _inputs() -> tuple[torch.Tensor, dict]:
    """Row 0: an image of 8x10 patches (20 tokens); row 1: a 4-frame video (8 tokens) and an
    image of 4x4 patches (4 tokens); equal lengths, no padding."""
    row0 = [5, 6, START, *[IMAGE] * 20, END, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    row1 = [16, START, *[VIDEO] * 8, END, 17, START, *[IMAGE] * 4, END, 18, 19]
    row1 += list(range(30, 30 + len(row0) - len(row1)))
    ids = torch.tensor([row0, row1])
    pixels = torch.randn(int(GRIDS.prod(-1).sum()), 24, generator=torch.Generator().manual_seed(1))
    images = GRIDS[:2]
    vision = {
        "pixel_values": pixels[: int(images.prod(-1).sum())],
        "image_grid_thw": images,
        "pixel_values_videos": pixels[int(images.prod(-1).sum()) :],
        "video_grid_thw": GRIDS[2:],
    }
    return ids, vision


def megatron_model(hf) -> QwenVLModel:
    cfg = hf.config
    tower, preset, state = model_to_megatron(cfg.to_dict(), hf.state_dict().__getitem__)
    seconds = getattr(cfg.vision_config, "tokens_per_second", None)
    tokens = VisionTokens(cfg.image_token_id, cfg.video_token_id, 2,
                          seconds if tower.kind == "qwen2_5_vl" else None)  # fmt: skip
    model = QwenVLModel(tower, tower_transformer_config(tower), preset,
                        gpt.transformer_config(preset), tokens).eval()  # fmt: skip
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    return model


def _case(kind: str) -> tuple:
    """The HF model, the Megatron inputs and transformers' logits on them."""
    hf = _hf(kind, **TEXT)
    hf.config.text_config._attn_implementation = "eager"
    ids, vision = _inputs()
    inputs = {"input_ids": ids, **vision}
    if kind == "qwen2_5_vl":
        inputs["second_per_grid_ts"] = torch.tensor([seconds_per_grid()])
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    with torch.no_grad():
        want = hf(mm_token_type_ids=types, **inputs).logits
    return hf, inputs, want


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_logits_equal_transformers(kind: str) -> None:
    hf, inputs, want = _case(kind)
    with megatron_session():
        model = megatron_model(hf)
        with torch.no_grad():
            got = model(**inputs).float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_more_pad_tokens_than_features_is_one_line() -> None:
    hf = _hf("qwen2_vl", **TEXT)
    ids, vision = _inputs()
    ids[0, 2] = IMAGE  # one more image pad token than the first image has features
    with megatron_session():
        model = megatron_model(hf)
        with pytest.raises(ValueError, match="21 image pad tokens in a row for an image of 20"):
            model(ids, **vision)
        # positions given: the count check of the features themselves
        with pytest.raises(ValueError, match="25 image pad tokens in the prompt for 24 image"):
            model(ids, **vision, position_ids=torch.zeros(3, *ids.shape, dtype=torch.long))


@pytest.mark.parametrize(
    "kind", [pytest.param("qwen2_vl", marks=pytest.mark.slow), "qwen2_5_vl"]
)  # suite budget: 2.5-VL (windows) stays in CI
def test_tp2_logits_equal_transformers(kind: str) -> None:
    """Tower and language model split over two tensor-parallel ranks (gloo)."""
    from anyspeed.testing import run_distributed
    from helpers import qwen_vl_ranks

    hf, inputs, want = _case(kind)
    _, _, state = model_to_megatron(hf.config.to_dict(), hf.state_dict().__getitem__)
    res = run_distributed(qwen_vl_ranks.qwen_vl_logits, 2, state=state,
                          config_json=hf.config.to_dict(), tp=2, inputs=inputs)  # fmt: skip
    got = torch.cat([r["logits"] for r in res], dim=-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_hf_megatron_hf_is_byte_identical_from_either_name_layout(kind: str) -> None:
    """Converted to Megatron and back, every HF tensor is bit-identical; a checkpoint in the
    older layout (``visual.*``, ``model.*``) reads the same."""
    from anyspeed.convert.qwen_vl import current_name, model_to_hf

    hf = _hf(kind, **TEXT)
    sd = hf.state_dict()
    old = {("visual." + k[len("model.visual.") :]) if k.startswith("model.visual.")
           else ("model." + k[len("model.language_model.") :])
           if k.startswith("model.language_model.") else k: v for k, v in sd.items()}  # fmt: skip
    assert set(old) != set(sd)
    by_current = {current_name(k): v for k, v in old.items()}
    tower, preset, state = model_to_megatron(hf.config.to_dict(), sd.__getitem__)
    _, _, from_old = model_to_megatron(hf.config.to_dict(), by_current.__getitem__)
    assert all(torch.equal(from_old[k], state[k]) for k in state)
    back = model_to_hf(tower, preset, state)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
