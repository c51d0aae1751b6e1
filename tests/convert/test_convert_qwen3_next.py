"""Qwen3-Next (gated DeltaNet layers between gated full-attention ones, zero-centred norms,
partial RoPE, a MoE with a gated shared expert) against transformers' ``Qwen3NextForCausalLM``:
the preset's parameter count, a tiny random model's logits after conversion (within 1e-4, fp32;
at TP2, and at EP2 x TP2 x PP2 with ``-m slow``), and the conversion back bit-identical from
torch_dist and from legacy rank files at TP2 x PP2 x EP2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_convert import _check, _load_hf_tensors

from anyspeed.convert import hf_to_megatron, megatron_to_hf
from anyspeed.convert.verify import hf_logits
from anyspeed.models.hf import hf_config, preset_from_hf
from anyspeed.models.presets import PRESETS
from anyspeed.testing import run_distributed
from helpers import convert_ranks

# Longer than the DeltaNet's convolution (4) and several RoPE periods of the rotated quarter.
TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(7))


def test_preset_has_the_published_parameter_count():
    """80B total (transformers' model of the published config, its MTP layer aside), about 3B
    active per token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = PRESETS["qwen3-next-80b-a3b"]
    cfg = hf_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    assert preset.num_parameters() == sum(p.numel() for p in model.parameters())
    assert preset.num_parameters() == pytest.approx(79.67e9, rel=1e-3)
    assert 3.0e9 < preset.active_parameters() < 4.0e9


def test_hf_config_reads_back_and_names_what_it_cannot_express():
    preset = PRESETS["qwen3-next-80b-a3b"]
    cfg = {**hf_config(preset), "architectures": ["Qwen3NextForCausalLM"]}
    assert preset_from_hf(cfg, preset.name).same_architecture(preset) == []
    with pytest.raises(ValueError, match="layer_types"):
        preset_from_hf({**cfg, "layer_types": ["linear_attention"]})
    with pytest.raises(ValueError, match="rope scaling"):
        preset_from_hf({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_next")
    convert_ranks.tiny_hf_model(d / "hf", "tiny-qwen3-next", seed=3)
    case = {"hf": str(d / "hf"), "torch_dist": str(d / "dist"), "hf_from_dist": str(d / "back")}
    tp1 = run_distributed(convert_ranks.convert_all, 1, cases={"q": case}, tokens=TOKENS,
                          cli_case="q", timeout=300)[0]["q"]  # fmt: skip
    return {"dir": d, "case": case, "ref": hf_logits(d / "hf", TOKENS), "tp1": tp1}


def test_logits_match_transformers(qwen3_next):
    assert qwen3_next["tp1"]["rc"] == 0, qwen3_next["tp1"]["stdout"]
    _check(qwen3_next["ref"], qwen3_next["tp1"]["dist"])


def test_torch_dist_round_trip_is_bit_identical(qwen3_next):
    ref = _load_hf_tensors(Path(qwen3_next["case"]["hf"]))
    got = _load_hf_tensors(Path(qwen3_next["case"]["hf_from_dist"]))
    assert set(got) == set(ref) and "model.layers.0.linear_attn.in_proj_qkvz.weight" in ref
    assert all(torch.equal(got[k], t) for k, t in ref.items())


def test_legacy_tp2_pp2_ep2_round_trip_is_bit_identical(qwen3_next):
    """Legacy rank files split the DeltaNet's projection and convolution over TP part by part
    (each rank its rows of q, k, v, z, beta, alpha), as Megatron's layer holds them."""
    d = qwen3_next["dir"]
    hf_to_megatron(d / "hf", d / "legacy", tp=2, pp=2, ep=2, ckpt_format="legacy")
    megatron_to_hf(d / "legacy", d / "back_legacy", d / "hf")
    ref, got = _load_hf_tensors(d / "hf"), _load_hf_tensors(d / "back_legacy")
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], t) for k, t in ref.items())


def test_logits_match_transformers_at_tp2(qwen3_next):
    """Megatron splits the DeltaNet's projection, convolution and decay per head over TP."""
    ranks = run_distributed(convert_ranks.layout_logits, 2, cases={"q": qwen3_next["case"]},
                            tp=2, pp=1, tokens=TOKENS, timeout=300)  # fmt: skip
    _check(qwen3_next["ref"], ranks[0]["q"]["dist"])


@pytest.mark.slow  # eight processes
def test_logits_match_transformers_ep2_tp2_pp2(qwen3_next):
    """torch_dist, and the legacy rank files loaded with ``load_state_dict(strict=True)``."""
    d = qwen3_next["dir"]
    if not (d / "legacy").exists():
        hf_to_megatron(d / "hf", d / "legacy", tp=2, pp=2, ep=2, ckpt_format="legacy")
    case = {**qwen3_next["case"], "legacy": str(d / "legacy")}
    ranks = run_distributed(convert_ranks.layout_logits, 8, cases={"q": case}, tp=2, pp=2,
                            ep=2, tokens=TOKENS, timeout=600)  # fmt: skip
    assert ranks[-1]["q"]["shape_mismatch"] == []
    _check(qwen3_next["ref"], ranks[-1]["q"]["dist"])
    _check(qwen3_next["ref"], ranks[-1]["q"]["legacy"])
