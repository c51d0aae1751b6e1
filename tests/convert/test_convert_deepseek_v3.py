"""DeepSeek-V3 (low-rank queries, sigmoid routing with the expert-bias correction, group-limited
top-k, the routed scaling factor, dense first layers, and a multi-token prediction layer stored
as the HF layer after the last) against transformers' ``DeepseekV3ForCausalLM``: the preset's
parameter count, a tiny random model's logits after conversion (within 1e-4, fp32; at
EP2 x TP2 x PP2 with ``-m slow``), and conversions back bit-identical, MTP layer included, from
torch_dist and from the legacy layout split over TP2 x PP2 x EP2."""

from __future__ import annotations

import json
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

TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(7))


def test_preset_has_the_published_parameter_count():
    """671B without the MTP layer (= transformers' model, which has none), 37B active."""
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = PRESETS["deepseek-v3"]
    cfg = hf_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    main = preset.num_parameters() - preset.mtp_parameters()
    assert main == sum(p.numel() for p in model.parameters())
    assert main == pytest.approx(671e9, rel=1e-3)
    assert preset.active_parameters() == pytest.approx(37e9, rel=0.02)


@pytest.fixture(scope="module")
def ds3(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek_v3")
    convert_ranks.tiny_hf_model(d / "hf", "tiny-deepseek-v3", seed=3)
    convert_ranks.add_mtp_layers(d / "hf", seed=5)
    case = {"hf": str(d / "hf"), "torch_dist": str(d / "dist"), "hf_from_dist": str(d / "back")}
    res = run_distributed(convert_ranks.convert_all, 1, cases={"ds3": case}, tokens=TOKENS,
                          cli_case="ds3", timeout=300)[0]["ds3"]  # fmt: skip
    return {"dir": d, "case": case, "ref": hf_logits(d / "hf", TOKENS), "tp1": res}


def test_logits_match_transformers(ds3):
    assert ds3["tp1"]["rc"] == 0, ds3["tp1"]["stdout"]
    _check(ds3["ref"], ds3["tp1"]["dist"])


def test_torch_dist_round_trip_is_bit_identical_with_the_mtp_layer(ds3):
    ref = _load_hf_tensors(Path(ds3["case"]["hf"]))
    got = _load_hf_tensors(Path(ds3["case"]["hf_from_dist"]))
    assert "model.layers.3.eh_proj.weight" in ref and "model.layers.3.mlp.gate.weight" in ref
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], t) for k, t in ref.items())
    cfg = json.loads((Path(ds3["case"]["hf_from_dist"]) / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1


def test_legacy_tp2_pp2_ep2_round_trip_is_bit_identical(ds3):
    d = ds3["dir"]
    hf_to_megatron(d / "hf", d / "legacy", tp=2, pp=2, ep=2, ckpt_format="legacy",
                   num_layer_list="2,1")  # fmt: skip
    megatron_to_hf(d / "legacy", d / "back_legacy", d / "hf")
    ref, got = _load_hf_tensors(d / "hf"), _load_hf_tensors(d / "back_legacy")
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], t) for k, t in ref.items())


def test_a_checkpoint_without_mtp_layers_converts_without_them(tmp_path):
    """transformers' own model keeps no MTP layer, whatever num_nextn_predict_layers says."""
    convert_ranks.tiny_hf_model(tmp_path / "hf", "tiny-deepseek-v3", seed=1)
    hf_to_megatron(tmp_path / "hf", tmp_path / "mg")
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", tmp_path / "hf")
    ref, got = _load_hf_tensors(tmp_path / "hf"), _load_hf_tensors(tmp_path / "back")
    assert set(got) == set(ref) and not any("eh_proj" in k for k in got)


@pytest.mark.parametrize("change,words", [
    ({"rope_interleave": False}, "rope_interleave"),
    ({"num_experts_per_tok": 3}, "topk_group"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
])  # fmt: skip
def test_configs_megatron_cannot_express_are_one_line(tmp_path, change, words):
    d = tmp_path / "hf"
    convert_ranks.tiny_hf_model(d, "tiny-deepseek-v3", seed=1)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ConvertError) as err:
        hf_to_megatron(d, tmp_path / "mg")
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "mg").exists()


@pytest.mark.slow  # eight processes
def test_logits_match_transformers_ep2_tp2_pp2(ds3):
    """torch_dist and the legacy rank files (strict load) at EP2 x TP2 x PP2."""
    d = ds3["dir"]
    if not (d / "legacy").exists():
        hf_to_megatron(d / "hf", d / "legacy", tp=2, pp=2, ep=2, ckpt_format="legacy",
                       num_layer_list="2,1")  # fmt: skip
    case = dict(ds3["case"], legacy=str(d / "legacy"), stages="2,1")
    ranks = run_distributed(convert_ranks.layout_logits, 8, cases={"ds3": case}, tp=2, pp=2,
                            ep=2, tokens=TOKENS, timeout=600)  # fmt: skip
    got = ranks[-1]["ds3"]
    assert got["shape_mismatch"] == []
    _check(ds3["ref"], got["dist"])
    _check(ds3["ref"], got["legacy"])


def test_mtp_num_layers_0_leaves_the_mtp_layer_out(ds3, tmp_path, capsys):
    """MindSpeed-LLM's --mtp-num-layers: 0 converts the model without its MTP layer; more
    layers than the checkpoint holds is one line."""
    from anyspeed.commands.convert import main as convert_main

    d = ds3["dir"]
    hf_to_megatron(d / "hf", tmp_path / "mg", mtp_num_layers=0)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", d / "hf")
    ref, got = _load_hf_tensors(d / "hf"), _load_hf_tensors(tmp_path / "back")
    assert set(got) == {k for k in ref if not k.startswith("model.layers.3.")}
    assert all(torch.equal(got[k], ref[k]) for k in got)
    argv = ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(d / "hf"),
            "--save-dir", str(tmp_path / "x"), "--mtp-num-layers", "2"]  # fmt: skip
    assert convert_main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "--mtp-num-layers 2: the checkpoint holds 1" in err and "\n" not in err
    assert not (tmp_path / "x").exists()
