"""Gemma 3's text model (QK norm, five windowed layers to a full one with a RoPE base of their
own, linear-scaled RoPE on the full layers, Gemma 2's sandwich norms, tanh GeGLU and scaled,
tied embeddings) against transformers' ``Gemma3ForCausalLM``: the presets' parameter counts,
a tiny random model's logits after conversion (within 1e-4, fp32; at TP2 with sequence
parallelism x PP2 with ``-m slow``), each RoPE shown to matter, the conversion back
bit-identical."""

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

TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize(
    "name,total",
    [("gemma3-1b", 0.99989e9), ("gemma3-4b", 3.880e9), ("gemma3-12b", 11.766e9),
     ("gemma3-27b", 27.009e9)],
)  # fmt: skip
def test_presets_have_transformers_parameter_counts(name, total):
    """1B: the published 999,885,952; the others: the text models of the published configs."""
    assert_preset_is_transformers(name, total, "Gemma3ForCausalLM", rel=1e-4)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return converted_tiny(tmp_path_factory.mktemp("gemma3"), "tiny-gemma3", "gemma3", TOKENS, 6)


def test_logits_match_transformers(gemma3):
    assert gemma3["one"]["rc"] == 0, gemma3["one"]["stdout"]
    _check(gemma3["ref"], gemma3["one"]["dist"])


def test_torch_dist_round_trip_is_bit_identical(gemma3):
    ref = _load_hf_tensors(Path(gemma3["case"]["hf"]))
    got = _load_hf_tensors(Path(gemma3["case"]["hf_from_dist"]))
    assert "model.layers.2.self_attn.k_norm.weight" in ref
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], t) for k, t in ref.items())


@pytest.mark.parametrize(
    "rope",
    [
        {"sliding_attention": {"rope_type": "default", "rope_theta": 1e6}},  # one base
        {"full_attention": {"rope_type": "default", "rope_theta": 1e6}},  # no linear factor
    ],
    ids=["one-base", "no-factor"],
)
def test_each_rope_changes_the_logits(gemma3, tmp_path, rope):
    """transformers with the windowed layers on the full layers' base, or without the full
    layers' factor, gives other logits than the converted model."""
    other = tmp_path / "hf"
    shutil.copytree(gemma3["case"]["hf"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], **rope}
    (other / "config.json").write_text(json.dumps(cfg))
    diff = (hf_logits(other, TOKENS) - gemma3["one"]["dist"][..., :512]).abs().max()
    assert diff > 1e-2


@pytest.mark.slow  # four processes
def test_logits_match_transformers_tp2_sp_pp2(gemma3):
    case = dict(gemma3["case"], stages="2,1")
    ranks = run_distributed(convert_ranks.layout_logits, 4, cases={"gemma3": case}, tp=2, pp=2,
                            sp=True, tokens=TOKENS, timeout=600)  # fmt: skip
    _check(gemma3["ref"], ranks[-1]["gemma3"]["dist"])


def test_the_vision_language_checkpoint_is_one_line():
    from anyspeed.models.hf import hf_family

    with pytest.raises(ValueError, match="Gemma 3's vision-language model") as err:
        hf_family({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})
    assert "\n" not in str(err.value)


def _legacy(preset: str, **keys) -> dict:
    """``preset``'s HF config in the older form Google's published config.json files have:
    no ``layer_types`` or nested ``rope_parameters``, top-level RoPE keys instead."""
    from anyspeed.models.hf import hf_config

    cfg = hf_config(PRESETS[preset])
    for k in ("layer_types", "rope_parameters"):
        cfg.pop(k, None)
    return {**cfg, **keys}


@pytest.mark.parametrize(
    "preset,keys",
    [
        ("gemma3-4b", dict(rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=6,
                           rope_scaling={"rope_type": "linear", "factor": 8.0})),
        ("gemma3-1b", dict(rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=6,
                           rope_scaling=None)),
        ("gemma2-9b", dict(rope_theta=10000.0)),
    ],
)  # fmt: skip
def test_older_config_files_read_as_transformers_reads_them(preset, keys):
    """The legacy keys (``rope_scaling`` of the full layers only, ``rope_local_base_freq``, a
    ``sliding_window_pattern`` for ``layer_types``) give the model transformers builds from the
    same file, and the preset."""
    from transformers import AutoConfig

    from anyspeed.models.hf import preset_from_hf

    legacy = _legacy(preset, **keys)
    arch = PRESETS[preset].family.replace("_text", "")
    arch = {"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}[arch]
    ours = preset_from_hf({**legacy, "architectures": [arch]}, preset)
    theirs = AutoConfig.for_model(legacy["model_type"], **{k: v for k, v in legacy.items()
                                                           if k != "model_type"})  # fmt: skip
    read = preset_from_hf({**theirs.to_dict(), "architectures": [arch]}, preset)
    assert ours.same_architecture(read) == [] and ours.same_architecture(PRESETS[preset]) == []
