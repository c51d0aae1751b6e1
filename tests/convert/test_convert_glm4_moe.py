"""GLM-4.5 and GLM-4.5-Air against transformers' ``Glm4MoeForCausalLM``: the presets' sizes,
and tiny random models of their traits (biases on Q, K, V; RoPE on half of each head; QK norm
for GLM-4.5, none for Air; sigmoid routing with the expert bias and a routed scaling factor; a
shared expert; a dense first layer): logits after conversion within 1e-4 of transformers'
(fp32), at TP2 and EP2 with ``-m slow``, and the conversion back bit-identical."""

from __future__ import annotations

import json

import pytest
import torch
from test_convert import _check, _load_hf_tensors

from anyspeed.convert.verify import hf_logits
from anyspeed.models.hf import hf_config
from anyspeed.models.presets import PRESETS
from helpers import convert_ranks
from helpers.family_convert import assert_layout_logits, assert_round_trip, converted

TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(13))
# the model cards' totals (355B, 106B; they match the counts without the MTP layer within 1%)
# and active parameters (32B, 12B)
SIZES = {"glm-4.5": (355e9, 32e9), "glm-4.5-air": (106e9, 12e9)}


@pytest.mark.parametrize("name", list(SIZES))
def test_presets_are_the_published_sizes(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = PRESETS[name]
    cfg = hf_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    main = preset.num_parameters() - preset.mtp_parameters()
    assert main == sum(p.numel() for p in model.parameters())  # transformers has no MTP layer
    total, active = SIZES[name]
    assert main == pytest.approx(total, rel=0.01)
    assert preset.active_parameters() == pytest.approx(active, rel=0.12)


@pytest.mark.parametrize("name", ["tiny-glm-4.5", "tiny-glm-4.5-air"])
def test_tiny_converts_to_transformers_logits_and_back(tmp_path, name):
    case, res = converted(tmp_path, name, TOKENS, seed=6)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["use_qk_norm"] == (name == "tiny-glm-4.5") and cfg["attention_bias"]
    _check(hf_logits(tmp_path / "hf", TOKENS), res["dist"])
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in assert_round_trip(case)


@pytest.mark.slow  # two two-process groups
@pytest.mark.parametrize("layout", [dict(tp=2, pp=1), dict(tp=1, pp=1, ep=2)])
def test_logits_match_transformers_at_tp2_and_ep2(tmp_path, layout):
    assert_layout_logits(tmp_path, "tiny-glm-4.5", TOKENS, 6, layout)


def test_mtp_layer_converts_and_comes_back(tmp_path):
    """GLM-4.5's checkpoints keep its MTP layer as the layer after the last (transformers'
    model skips it): converted into Megatron's MTP block, written back bit-identically."""
    from anyspeed.convert import hf_to_megatron, megatron_to_hf

    convert_ranks.tiny_hf_model(tmp_path / "hf", "tiny-glm-4.5", seed=6)
    convert_ranks.add_mtp_layers(tmp_path / "hf", seed=7)
    hf_to_megatron(tmp_path / "hf", tmp_path / "mg")
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", tmp_path / "hf")
    ref, got = _load_hf_tensors(tmp_path / "hf"), _load_hf_tensors(tmp_path / "back")
    assert "model.layers.3.eh_proj.weight" in ref and "model.layers.3.mlp.gate.weight" in ref
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], t) for k, t in ref.items())
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
