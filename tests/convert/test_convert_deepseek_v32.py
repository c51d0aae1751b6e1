"""DeepSeek-V3.2 against transformers' ``DeepseekV32ForCausalLM``: the preset's size, and a tiny
random model whose sequences (24 tokens) are longer than the keys each query keeps (6), so the
indexer's choice shows in every later position: logits after conversion within 1e-4 of
transformers' (fp32), at TP2 and EP2 with ``-m slow``, and the conversion back bit-identical."""

from __future__ import annotations

import json

import pytest
import torch
from test_convert import _check

from anyspeed.convert.verify import hf_logits
from anyspeed.models.hf import hf_config
from anyspeed.models.presets import PRESETS
from helpers import convert_ranks
from helpers.family_convert import assert_layout_logits, assert_round_trip, converted

TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(17))


def test_preset_is_deepseek_v32s_size():
    """DeepSeek-V3's 671B plus a 64-head indexer in each of the 61 layers (about 0.85B);
    transformers' model has no MTP layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = PRESETS["deepseek-v3.2"]
    cfg = hf_config(preset)
    assert cfg["model_type"] == "deepseek_v32" and cfg["index_topk"] == 2048
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    main = preset.num_parameters() - preset.mtp_parameters()
    assert main == sum(p.numel() for p in model.parameters())
    v3 = PRESETS["deepseek-v3"]
    assert main - (v3.num_parameters() - v3.mtp_parameters()) == pytest.approx(0.85e9, rel=0.01)


def test_sparsity_changes_transformers_logits(tmp_path):
    """The test sequences reach past ``index_topk``: the sparse model's logits differ from the
    same weights attending to every key (else the parity below would not test the indexer)."""
    convert_ranks.tiny_hf_model(tmp_path / "sparse", "tiny-deepseek-v3.2", seed=4)
    convert_ranks.tiny_hf_model(tmp_path / "dense", "tiny-deepseek-v3.2", seed=4, index_topk=64)
    sparse, dense = hf_logits(tmp_path / "sparse", TOKENS), hf_logits(tmp_path / "dense", TOKENS)
    topk = PRESETS["tiny-deepseek-v3.2"].dsa_indexer_topk
    assert torch.allclose(sparse[:, :topk], dense[:, :topk], atol=1e-5)
    assert (sparse[:, topk:] - dense[:, topk:]).abs().amax() > 1e-2


def test_tiny_converts_to_transformers_logits_and_back(tmp_path):
    case, res = converted(tmp_path, "tiny-deepseek-v3.2", TOKENS, seed=4)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["index_topk"] == 6 and cfg["index_n_heads"] == 8
    _check(hf_logits(tmp_path / "hf", TOKENS), res["dist"])
    ref = assert_round_trip(case)
    assert "model.layers.0.self_attn.indexer.k_norm.bias" in ref


@pytest.mark.slow  # two two-process groups
@pytest.mark.parametrize("layout", [dict(tp=2, pp=1), dict(tp=1, pp=1, ep=2)])
def test_logits_match_transformers_at_tp2_and_ep2(tmp_path, layout):
    assert_layout_logits(tmp_path, "tiny-deepseek-v3.2", TOKENS, 4, layout)
