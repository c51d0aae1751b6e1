"""LLaVA on Megatron-Core (``anyspeed.models.multimodal``) against transformers'
``LlavaForConditionalGeneration``: the tower alone and the whole model's logits after conversion,
CLIP and SigLIP, fp32, at TP1 in this process and TP2 on gloo; the causal-mask trap of Megatron's
local ViT spec stays closed; the conversion back is bit-identical."""

from __future__ import annotations

import pytest
import torch

from anyspeed.convert import llava as conv
from anyspeed.convert.megatron_io import megatron_session
from anyspeed.models import gpt, multimodal
from anyspeed.models.vision import llava_from_hf
from anyspeed.testing import run_distributed
from helpers import llava, llava_ranks


def _megatron(hf):
    cfg = llava_from_hf(hf.config.to_dict())
    sd = hf.state_dict()
    state = conv.to_megatron(cfg, lambda n: sd[n], llava.VOCAB)
    model = multimodal.build_llava(cfg, gpt.transformer_config(cfg.language)).eval()
    conv.load_into(model, state, 1, 0)
    return cfg, model, state


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_tower_and_logits_equal_transformers_and_convert_back_exactly(kind):
    """Tower output = HF's hidden state at ``vision_feature_layer`` (1e-5); logits (1e-4); the
    Megatron state maps back to every HF tensor bit-identical (the unused last tower layer,
    the post-norm and SigLIP's head included)."""
    hf = llava.hf_model(kind)
    with megatron_session():
        cfg, model, _ = _megatron(hf)
        assert cfg.vision.num_layers == 2 and cfg.vision.hf_num_layers == 3
        images, hf_ids, mg_ids = llava.inputs(cfg.image_seq_len)
        with torch.no_grad():
            tower = model.vision_model(images)
            ref_tower = hf.model.vision_tower(images, output_hidden_states=True).hidden_states[-2]
            logits, _ = model(images, mg_ids, None, None)
            ref = hf(input_ids=hf_ids, pixel_values=images).logits
        torch.testing.assert_close(tower, ref_tower, rtol=0, atol=1e-5)
        assert logits.shape == ref.shape
        torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
        state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        back = conv.to_hf(cfg, state)
    sd = hf.state_dict()
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_every_patch_sees_every_other(kind):
    """Changing only the last patch changes the first position's tower output (Megatron's local
    ViT spec masked attention causally; ``vision-compat`` makes it bidirectional)."""
    hf = llava.hf_model(kind)
    with megatron_session():
        _, model, _ = _megatron(hf)
        images, _, _ = llava.inputs(16)
        moved = images.clone()
        moved[:, :, -8:, -8:] += 1.0
        with torch.no_grad():
            a, b = model.vision_model(images), model.vision_model(moved)
    assert (a[:, 0] - b[:, 0]).abs().max() > 1e-3


def test_logits_at_tp2_equal_transformers():
    """At TP2 (gloo) each rank's vocabulary slice, put together, equals transformers' logits."""
    hf = llava.hf_model("clip")
    cfg = llava_from_hf(hf.config.to_dict())
    sd = hf.state_dict()
    state = conv.to_megatron(cfg, lambda n: sd[n], llava.VOCAB)
    images, hf_ids, mg_ids = llava.inputs(cfg.image_seq_len)
    res = run_distributed(llava_ranks.llava_logits, 2, state=state,
                          config_json=hf.config.to_dict(), tp=2, images=images,
                          ids=mg_ids)  # fmt: skip
    logits = torch.cat([r["logits"] for r in res], dim=-1)
    with torch.no_grad():
        ref = hf(input_ids=hf_ids, pixel_values=images).logits
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)


def test_unsupported_configs_are_one_line_errors():
    bad = [
        (dict(vision_feature_layer=[-2, -1]), "only one layer"),
        (dict(vision_feature_select_strategy="default"), "SigLIP"),
        (dict(projector_hidden_act="relu"), "projector_hidden_act"),
    ]
    for changes, needle in bad:
        cfg = llava.hf_config("siglip", **changes).to_dict()
        with pytest.raises(ValueError, match=needle) as err:
            llava_from_hf(cfg)
        assert "\n" not in str(err.value)
