"""Gemma 2 (sandwich norms as ``1 + w``, soft-capped attention scores and logits, scores scaled by
``query_pre_attn_scalar``, alternating sliding-window layers, the tanh-GELU GLU, scaled and tied
embeddings) against transformers' ``Gemma2ForCausalLM``: the presets' parameter counts, a tiny
random model's logits after conversion (within 1e-4, fp32; at TP2 with sequence parallelism x
PP2 with ``-m slow``), each trait shown to matter, and the conversion back bit-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_convert import _check, _load_hf_tensors

from anyspeed.convert.verify import hf_logits
from anyspeed.testing import run_distributed
from helpers import convert_ranks
from helpers.family_presets import assert_preset_is_transformers, converted_tiny

# Longer than the window (3 keys before the row) so the sliding layers differ from full ones.
TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize(
    "name,total", [("gemma2-2b", 2.614e9), ("gemma2-9b", 9.242e9), ("gemma2-27b", 27.227e9)]
)
def test_presets_have_the_published_parameter_counts(name, total):
    """The published totals, exactly transformers' model of the config, and its config read
    back is the preset."""
    assert_preset_is_transformers(name, total, "Gemma2ForCausalLM", rel=1e-3)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return converted_tiny(tmp_path_factory.mktemp("gemma2"), "tiny-gemma2", "gemma2", TOKENS, 6)


def test_logits_match_transformers(gemma2):
    assert gemma2["one"]["rc"] == 0, gemma2["one"]["stdout"]
    _check(gemma2["ref"], gemma2["one"]["dist"])


def test_torch_dist_round_trip_is_bit_identical(gemma2):
    ref = _load_hf_tensors(Path(gemma2["case"]["hf"]))
    got = _load_hf_tensors(Path(gemma2["case"]["hf_from_dist"]))
    assert "model.layers.2.post_feedforward_layernorm.weight" in ref
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], t) for k, t in ref.items())


@pytest.mark.parametrize(
    "change",
    [
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
        {"query_pre_attn_scalar": 32},  # head_dim: the default scale
        {"sliding_window": 64},  # longer than the tokens: every layer sees all of them
    ],
    ids=lambda c: next(iter(c)),
)
def test_each_trait_changes_the_logits(gemma2, tmp_path, change):
    """transformers without the trait gives other logits than the converted model (so the
    match above needs it)."""
    import shutil

    other = tmp_path / "hf"
    shutil.copytree(gemma2["case"]["hf"], other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, **change}))
    diff = (hf_logits(other, TOKENS) - gemma2["one"]["dist"][..., :512]).abs().max()
    assert diff > 1e-2


@pytest.mark.slow  # four processes
def test_logits_match_transformers_tp2_sp_pp2(gemma2):
    case = dict(gemma2["case"], stages="2,1")
    ranks = run_distributed(convert_ranks.layout_logits, 4, cases={"gemma2": case}, tp=2, pp=2,
                            sp=True, tokens=TOKENS, timeout=600)  # fmt: skip
    _check(gemma2["ref"], ranks[-1]["gemma2"]["dist"])
