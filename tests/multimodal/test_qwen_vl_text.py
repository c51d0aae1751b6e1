"""The Qwen2-VL / Qwen2.5-VL language model on Megatron-Core with mRoPE (GPTModel's
``position_embedding_type='mrope'``) against transformers: the same HF weights through the Qwen2
family's mapping, the same 3-D positions (of a batch with images and a video, from
:func:`mrope_positions`), logits within 1e-4 in fp32."""

from __future__ import annotations

import pytest
import torch
from test_qwen_vl_positions import IMAGES, VIDEOS, _batch

from anyspeed.convert.megatron_io import megatron_session
from anyspeed.convert.qwen_vl import model_to_megatron
from anyspeed.models import gpt
from anyspeed.models.qwen_vl.positions import VisionTokens, mrope_positions
from helpers.qwen_vl import IMAGE, VIDEO, hf_config

SECTION = [2, 3, 3]  # head_dim 16: 8 frequency pairs (temporal, height, width)


def _hf(kind: str):
    import transformers

    rope = {"rope_type": "default", "mrope_section": SECTION, "rope_theta": 1e6}
    cfg = hf_config(kind, num_hidden_layers=2, intermediate_size=96, initializer_range=0.3,
                    rope_parameters=rope)  # fmt: skip
    cls = transformers.Qwen2VLForConditionalGeneration
    if kind == "qwen2_5_vl":
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _language_model(hf):
    """The text model as a Megatron GPTModel with mRoPE, HF's weights through the Qwen2
    mapping (``model.language_model.*`` read as ``model.*``)."""
    _, preset, state = model_to_megatron(hf.config.to_dict(), hf.state_dict().__getitem__)
    assert preset.position_embedding_type == "mrope" and preset.mrope_section == tuple(SECTION)
    lm = {k[len("language_model.") :]: v for k, v in state.items() if k.startswith("language_")}
    model = gpt.build(preset, gpt.transformer_config(preset)).eval()
    missing, unexpected = model.load_state_dict(lm, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    return model


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_mrope_logits_equal_transformers(kind: str) -> None:
    hf = _hf(kind)
    ids, mask = _batch()
    extra = {"second_per_grid_ts": torch.tensor([0.5])} if kind == "qwen2_5_vl" else {}
    spec = VisionTokens(IMAGE, VIDEO, 2, 4 if kind == "qwen2_5_vl" else None)
    positions, _ = mrope_positions(ids, spec, IMAGES, VIDEOS, attention_mask=mask, **extra)
    tokens = torch.where(mask.bool(), ids % 200, 0)  # text embeddings only: no pixels here
    with megatron_session():
        model = _language_model(hf)
        with torch.no_grad():
            # causal attention over whole rows (padding included) on both sides
            got = model(tokens, positions, None).float()
            want = hf(input_ids=tokens, position_ids=positions).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert positions[1].ne(positions[0]).any()  # the positions are really 3-D
