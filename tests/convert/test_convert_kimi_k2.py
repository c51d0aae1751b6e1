"""Kimi-K2: DeepSeek-V3's architecture (its config names ``DeepseekV3ForCausalLM``) at 64
heads, 384 experts routed without groups, one dense layer, YaRN with beta_fast = beta_slow = 1
and no multi-token prediction layer. The preset's size against transformers' model of its
config, and a tiny random model of its traits: logits after conversion equal transformers'
within 1e-4 (fp32; the YaRN betas reach Megatron's MLA, or every position's rotation differs),
and the conversion back is bit-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_convert import _check

from anyspeed.convert.verify import hf_logits
from anyspeed.models.hf import hf_config
from anyspeed.models.presets import PRESETS
from helpers.family_convert import assert_layout_logits, assert_round_trip, converted

TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(11))


def test_preset_is_kimi_k2s_size():
    """About 1T parameters, 32B active (the model card's figures), transformers' count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = PRESETS["kimi-k2"]
    cfg = hf_config(preset)
    assert cfg["model_type"] == "deepseek_v3" and cfg["n_group"] == 1
    assert cfg["rope_scaling"]["beta_fast"] == 1.0 and cfg["num_nextn_predict_layers"] == 0
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    assert preset.num_parameters() == sum(p.numel() for p in model.parameters())
    assert preset.num_parameters() == pytest.approx(1.03e12, rel=0.01)
    assert preset.active_parameters() == pytest.approx(32.9e9, rel=0.01)


def test_tiny_kimi_k2_converts_to_transformers_logits_and_back(tmp_path):
    case, res = converted(tmp_path, "tiny-kimi-k2", TOKENS, seed=4)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_parameters"]["beta_fast"] == 1.0 and cfg["n_group"] == 1  # transformers 5
    _check(hf_logits(tmp_path / "hf", TOKENS), res["dist"])
    assert_round_trip(case)
    back = json.loads((Path(case["hf_from_dist"]) / "config.json").read_text())
    rope = back.get("rope_parameters") or back["rope_scaling"]
    assert rope["beta_fast"] == 1.0 and rope["beta_slow"] == 1.0


@pytest.mark.slow  # two two-process groups
@pytest.mark.parametrize("layout", [dict(tp=2, pp=1), dict(tp=1, pp=1, ep=2)])
def test_logits_match_transformers_at_tp2_and_ep2(tmp_path, layout):
    assert_layout_logits(tmp_path, "tiny-kimi-k2", TOKENS, 4, layout)
