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
from test_convert import _check, _load_hf_tensors

from anyspeed.convert.verify import hf_logits
from anyspeed.models.hf import hf_config
from anyspeed.models.presets import PRESETS
from anyspeed.testing import run_distributed
from helpers import convert_ranks

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
    convert_ranks.tiny_hf_model(tmp_path / "hf", "tiny-kimi-k2", seed=4)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_parameters"]["beta_fast"] == 1.0 and cfg["n_group"] == 1  # transformers 5
    case = {"hf": str(tmp_path / "hf"), "torch_dist": str(tmp_path / "dist"),
            "hf_from_dist": str(tmp_path / "back")}  # fmt: skip
    res = run_distributed(convert_ranks.convert_all, 1, cases={"kimi": case}, tokens=TOKENS,
                          cli_case="kimi", timeout=300)[0]["kimi"]  # fmt: skip
    assert res["rc"] == 0, res["stdout"]
    _check(hf_logits(tmp_path / "hf", TOKENS), res["dist"])
    ref, got = _load_hf_tensors(tmp_path / "hf"), _load_hf_tensors(Path(case["hf_from_dist"]))
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], t) for k, t in ref.items())
    back = json.loads((Path(case["hf_from_dist"]) / "config.json").read_text())
    rope = back.get("rope_parameters") or back["rope_scaling"]
    assert rope["beta_fast"] == 1.0 and rope["beta_slow"] == 1.0
