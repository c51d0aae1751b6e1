"""GPT-OSS (sinks, alternating sliding windows, experts with biases stored stacked with gate and
up interleaved, the clamped quick-GELU GLU, YaRN RoPE) against transformers'
``GptOssForCausalLM``: the presets' parameter counts, a tiny random model's logits after
conversion (within 1e-4, fp32; at EP2 x TP2 x PP2 with ``-m slow``), and conversions back
bit-identical, from torch_dist and from the legacy layout split over PP2 x EP2 (legacy at TP > 1
is refused: its rank files split experts over TP, which biased experts cannot be)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_convert import _check, _load_hf_tensors

from anyspeed.convert import hf_to_megatron, megatron_to_hf
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.verify import hf_logits
from anyspeed.models.hf import hf_config
from anyspeed.models.presets import PRESETS
from anyspeed.testing import run_distributed
from helpers import convert_ranks

# Long enough for the window (3 keys before the row) and the sinks to matter.
TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name,total", [("gpt-oss-20b", 20.91e9), ("gpt-oss-120b", 116.83e9)])
def test_presets_have_the_published_parameter_counts(name, total):
    """The published totals (20.9B, 116.8B), and exactly transformers' model of the config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = PRESETS[name]
    cfg = hf_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    assert preset.num_parameters() == sum(p.numel() for p in model.parameters())
    assert preset.num_parameters() == pytest.approx(total, rel=1e-3)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss")
    convert_ranks.tiny_hf_model(d / "hf", "tiny-gpt-oss", seed=4)
    case = {"hf": str(d / "hf"), "torch_dist": str(d / "dist"), "hf_from_dist": str(d / "back")}
    ep1 = run_distributed(convert_ranks.convert_all, 1, cases={"gpt-oss": case}, tokens=TOKENS,
                          cli_case="gpt-oss", timeout=300)[0]["gpt-oss"]  # fmt: skip
    return {"dir": d, "case": case, "ref": hf_logits(d / "hf", TOKENS), "ep1": ep1}


def test_logits_match_transformers(gpt_oss):
    assert gpt_oss["ep1"]["rc"] == 0, gpt_oss["ep1"]["stdout"]
    _check(gpt_oss["ref"], gpt_oss["ep1"]["dist"])


def test_torch_dist_round_trip_is_bit_identical(gpt_oss):
    ref = _load_hf_tensors(Path(gpt_oss["case"]["hf"]))
    got = _load_hf_tensors(Path(gpt_oss["case"]["hf_from_dist"]))
    assert set(got) == set(ref) and "model.layers.1.self_attn.sinks" in ref
    assert all(torch.equal(got[k], t) for k, t in ref.items())


def test_legacy_pp2_ep2_round_trip_is_bit_identical(gpt_oss):
    d = gpt_oss["dir"]
    hf_to_megatron(d / "hf", d / "legacy", tp=1, pp=2, ep=2, ckpt_format="legacy")
    megatron_to_hf(d / "legacy", d / "back_legacy", d / "hf")
    ref, got = _load_hf_tensors(d / "hf"), _load_hf_tensors(d / "back_legacy")
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], t) for k, t in ref.items())


def test_legacy_at_tp2_is_refused_in_one_line(gpt_oss, tmp_path):
    """Legacy rank files split experts over TP; Megatron cannot split biased experts."""
    with pytest.raises(ConvertError) as err:
        hf_to_megatron(gpt_oss["dir"] / "hf", tmp_path / "x", tp=2, ckpt_format="legacy")
    assert "torch_dist" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # eight processes
def test_logits_match_transformers_ep2_tp2_pp2(gpt_oss):
    """torch_dist loaded at EP2 x TP2 x PP2 (expert TP 1: biased experts are not split)."""
    case = dict(gpt_oss["case"])
    ranks = run_distributed(convert_ranks.layout_logits, 8, cases={"gpt-oss": case}, tp=2, pp=2,
                            ep=2, etp=1, tokens=TOKENS, timeout=600)  # fmt: skip
    _check(gpt_oss["ref"], ranks[-1]["gpt-oss"]["dist"])
