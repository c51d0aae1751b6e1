"""Phi-3 / Phi-3.5 / Phi-4 (fused ``qkv_proj`` and ``gate_up_proj``, LongRoPE's two sets of
frequency factors and its attention factor, RoPE on 3/4 of each head, a sliding window)
against transformers' ``Phi3ForCausalLM``: the presets' parameter counts, a tiny random model's
logits after conversion past the pretraining length (long factors) and within it (short
factors), within 1e-4 in fp32 (at TP2 with sequence parallelism x PP2 with ``-m slow``), each
piece shown to matter, the conversion back bit-identical, and HF configs in their older forms
read as transformers reads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_convert import _check, _load_hf_tensors

from anyspeed.convert.verify import hf_logits
from anyspeed.models.presets import PRESETS
from anyspeed.testing import run_distributed
from helpers import convert_ranks
from helpers.family_presets import assert_preset_is_transformers, converted_tiny

# 24 tokens: past tiny-phi3's pretraining length (16), so transformers takes the long factors
TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(11))
SHORT = TOKENS[:, :12]  # within it: the short factors


@pytest.mark.parametrize(
    "name,total",
    [("phi3-mini-4k", 3.821e9), ("phi3-medium-4k", 13.960e9), ("phi3.5-mini", 3.821e9),
     ("phi4", 14.660e9)],
)  # fmt: skip
def test_presets_have_transformers_parameter_counts(name, total):
    """The published 3,821,079,552 (Phi-3-mini, Phi-3.5-mini), 13,960,238,080 (Phi-3-medium)
    and 14,659,507,200 (Phi-4), each equal to transformers' model of the preset's config."""
    assert_preset_is_transformers(name, total, "Phi3ForCausalLM", rel=1e-3)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return converted_tiny(tmp_path_factory.mktemp("phi3"), "tiny-phi3", "phi3", TOKENS, 4)


def test_logits_match_transformers_past_the_pretraining_length(phi3):
    assert phi3["one"]["rc"] == 0, phi3["one"]["stdout"]
    _check(phi3["ref"], phi3["one"]["dist"])


def _ours(phi3, tokens) -> torch.Tensor:
    """The converted model's logits of ``tokens`` in one process."""
    if tokens is TOKENS:
        return phi3["one"]["dist"]
    ranks = run_distributed(convert_ranks.layout_logits, 1, cases={"phi3": phi3["case"]},
                            tp=1, pp=1, tokens=tokens, timeout=300)  # fmt: skip
    return ranks[0]["phi3"]["dist"]


def test_logits_match_transformers_within_the_pretraining_length(phi3):
    _check(hf_logits(Path(phi3["case"]["hf"]), SHORT), _ours(phi3, SHORT))


def test_torch_dist_round_trip_is_bit_identical(phi3):
    ref = _load_hf_tensors(Path(phi3["case"]["hf"]))
    got = _load_hf_tensors(Path(phi3["case"]["hf_from_dist"]))
    assert "model.layers.1.self_attn.qkv_proj.weight" in ref
    assert "model.layers.1.mlp.gate_up_proj.weight" in ref
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], t) for k, t in ref.items())


def _changed(phi3, tmp_path, tokens, **keys) -> float:
    other = tmp_path / "hf"
    shutil.copytree(phi3["case"]["hf"], other)
    cfg = json.loads((other / "config.json").read_text())
    for key, value in keys.items():
        if key == "rope":
            cfg["rope_parameters"] = {**cfg["rope_parameters"], **value}
        else:
            cfg[key] = value
    (other / "config.json").write_text(json.dumps(cfg))
    return float((hf_logits(other, tokens) - _ours(phi3, tokens)[..., :512]).abs().max())


@pytest.mark.parametrize(
    "keys",
    [
        {"rope": {"long_factor": [1.0] * 6}},  # the long set unused
        {"rope": {"attention_factor": 1.0}},  # cos and sin unscaled
        {"sliding_window": None},  # no window
        {"rope": {"partial_rotary_factor": 1.0, "long_factor": [2.0] * 8,
                  "short_factor": [1.0] * 8}},  # every channel rotates
    ],
    ids=["long-factors", "attention-factor", "window", "partial"],
)  # fmt: skip
def test_each_piece_changes_the_logits(phi3, tmp_path, keys):
    """transformers without one of the pieces gives other logits than the converted model."""
    assert _changed(phi3, tmp_path, TOKENS, **keys) > 1e-2


def test_the_short_factors_matter_within_the_pretraining_length(phi3, tmp_path):
    assert _changed(phi3, tmp_path, SHORT, rope={"short_factor": [1.0] * 6}) > 1e-2


@pytest.mark.slow  # four processes
def test_logits_match_transformers_tp2_sp_pp2(phi3):
    case = dict(phi3["case"], stages="2,1")
    ranks = run_distributed(convert_ranks.layout_logits, 4, cases={"phi3": case}, tp=2, pp=2,
                            sp=True, tokens=TOKENS, timeout=600)  # fmt: skip
    _check(phi3["ref"], ranks[-1]["phi3"]["dist"])


@pytest.mark.parametrize(
    "keys",
    [
        dict(rope_scaling={"type": "su", "short_factor": list(PRESETS["phi3.5-mini"]
             .longrope_short_factor), "long_factor": list(PRESETS["phi3.5-mini"]
             .longrope_long_factor)}, sliding_window=262144, original_max_position_embeddings=4096),
        dict(rope_scaling={"type": "longrope", "short_factor": list(PRESETS["phi3.5-mini"]
             .longrope_short_factor), "long_factor": list(PRESETS["phi3.5-mini"]
             .longrope_long_factor)}, sliding_window=262144),
    ],
    ids=["su", "longrope-default-original"],
)  # fmt: skip
def test_older_config_files_read_as_transformers_reads_them(keys):
    """Phi-3.5-mini's published form (legacy ``rope_scaling``, a top-level pretraining length or
    Phi3Config's default of it, a window longer than the context) is the preset, and the model
    transformers builds from the same file."""
    from transformers import AutoConfig

    from anyspeed.models.hf import hf_config, preset_from_hf

    cfg = {k: v for k, v in hf_config(PRESETS["phi3.5-mini"]).items() if k != "model_type"}
    cfg.pop("original_max_position_embeddings")
    cfg.update(keys)
    ours = preset_from_hf({**cfg, "architectures": ["Phi3ForCausalLM"]}, "phi3.5-mini")
    theirs = AutoConfig.for_model("phi3", **cfg)
    read = preset_from_hf({**theirs.to_dict(), "architectures": ["Phi3ForCausalLM"]}, "phi3.5-mini")
    assert (
        ours.same_architecture(read) == [] and ours.same_architecture(PRESETS["phi3.5-mini"]) == []
    )
