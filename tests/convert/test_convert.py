"""``anyspeed convert``: HF <-> Megatron checkpoints for every supported family.

Tiny random ``transformers`` models (all weights, norms and biases random) are converted to
Megatron's torch_dist and legacy layouts; Megatron-Core's GPTModel loads them at TP1, TP2 and
PP2 (as ``pretrain --load`` does, and through ``load_state_dict(strict=True)`` for the legacy
rank files) and must give ``transformers``' logits within 1e-4 max-abs (fp32). Converting back
must reproduce every HF tensor bit for bit from either layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from anyspeed.checkpoint.record import read_model
from anyspeed.convert import hf_to_megatron, is_hf_dir, mapped, megatron_to_hf
from anyspeed.convert.verify import hf_logits
from anyspeed.testing import run_distributed
from helpers import convert_ranks

ATOL = 1e-4
CASES = {
    "llama2": dict(preset="tiny-llama2", shard="40KB"),  # sharded safetensors + index
    "llama3": dict(preset="tiny-llama3"),  # GQA, llama3 rope scaling
    "qwen2.5": dict(preset="tiny-qwen2.5"),  # QKV bias, tied embeddings
    "qwen3": dict(
        preset="tiny-qwen3",
        overrides={"vocab_size": 500},  # QK norm, head_dim 32,
        divisible_by=128,
        tp=2,
    ),  # tied; vocabulary padded to 512
    "mistral": dict(preset="tiny-mistral"),
    "llama3-1kv": dict(preset="tiny-llama3", overrides={"num_key_value_heads": 1}),
}
LEGACY = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
RESAVE = ("qwen2.5", "llama3-1kv")  # re-saved by Megatron itself at TP2 and at PP2


def _load_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(3))
    cases, ref = {}, {}
    for i, (name, spec) in enumerate(CASES.items()):
        d = root / name
        convert_ranks.tiny_hf_model(
            d / "hf", spec["preset"], seed=i, shard=spec.get("shard"), **spec.get("overrides", {})
        )
        ref[name] = hf_logits(d / "hf", tokens)
        case = {
            "hf": str(d / "hf"),
            "torch_dist": str(d / "dist"),
            "hf_from_dist": str(d / "hf_from_dist"),
            "tp": spec.get("tp", 1),
            "divisible_by": spec.get("divisible_by", 1),
        }
        for tag, (tp, pp) in LEGACY.items():  # legacy needs no process group: convert here
            if tag == "tp2pp2" and name not in ("qwen2.5", "qwen3"):
                continue
            with pytest.MonkeyPatch.context() as mp:
                if tag == "tp2":  # every mapped buffer file to file, not only those >= 64 KiB
                    mp.setattr(mapped, "MIN_RANGE", 1)
                hf_to_megatron(
                    d / "hf",
                    d / f"legacy_{tag}",
                    tp=tp,
                    pp=pp,
                    ckpt_format="legacy",
                    make_vocab_size_divisible_by=case["divisible_by"],
                )
                shard = "40KB" if tag == "pp2" else "5GB"  # pp2: several output shards
                megatron_to_hf(
                    d / f"legacy_{tag}", d / f"hf_from_{tag}", d / "hf", max_shard_size=shard
                )
            case[f"legacy_{tag}"] = str(d / f"legacy_{tag}")
        cases[name] = case
    tp1 = run_distributed(
        convert_ranks.convert_all, 1, cases=cases, tokens=tokens, cli_case="mistral", timeout=300
    )[0]
    out = {"cases": cases, "ref": ref, "tp1": tp1}
    for tag, (tp, pp) in (("tp2", (2, 1)), ("pp2", (1, 2))):
        with_legacy = {n: dict(c, legacy=c[f"legacy_{tag}"]) for n, c in cases.items()}
        for name in RESAVE:
            with_legacy[name]["resave"] = str(root / name / f"resaved_{tag}")
        out[tag] = run_distributed(convert_ranks.layout_logits, 2, cases=with_legacy, tp=tp,
                                   pp=pp, tokens=tokens, timeout=300)  # fmt: skip
    return out


def _check(ref: torch.Tensor, got: torch.Tensor) -> None:
    assert got is not None
    vocab = ref.shape[-1]
    assert got.shape[:-1] == ref.shape[:-1] and got.shape[-1] >= vocab
    assert ref.std() > 0.1  # the random weights give logits worth comparing
    diff = float((got[..., :vocab].float() - ref).abs().max())
    assert diff <= ATOL, f"max-abs logits difference {diff:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_tp1(conv, name):
    _check(conv["ref"][name], conv["tp1"][name]["dist"])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_logits_match_transformers_tp2_pp2(conv, layout, name):
    """Both layouts: torch_dist via dist_checkpointing.load, legacy via strict load_state_dict."""
    ranks = conv[layout]
    last = ranks[-1][name]
    for kind in ("dist", "legacy"):
        _check(conv["ref"][name], last[kind])
    if layout == "tp2":  # both TP ranks gather the same full-vocabulary logits
        assert torch.equal(ranks[0][name]["dist"], last["dist"])
    else:  # the first pipeline stage returns nothing
        assert ranks[0][name]["dist"] is None
    assert all(r[name]["shape_mismatch"] == [] for r in ranks)


@pytest.mark.parametrize("source", ["dist", "tp2", "pp2", "tp2pp2"])
def test_round_trip_is_bit_identical(conv, source):
    checked = 0
    for name, case in conv["cases"].items():
        if source != "dist" and f"legacy_{source}" not in case:
            continue
        ref = _load_hf_tensors(Path(case["hf"]))
        got = _load_hf_tensors(Path(case["hf"]).parent / f"hf_from_{source}")
        assert set(got) == set(ref), name
        for k, t in ref.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), f"{name}: {k}"
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_reads_checkpoints_megatron_wrote_at_other_layouts(conv, layout, tmp_path):
    """A torch_dist checkpoint saved by Megatron's own writer from a TP2 or PP2 model (chunks
    split per rank, replicas deduplicated) converts back to the original HF tensors, bit for
    bit; and the converter's streaming writer produced the same keys, shapes and dtypes."""
    from anyspeed.convert.dcp_io import DcpReader

    for name in RESAVE:
        case = conv["cases"][name]
        resaved = Path(case["hf"]).parent / f"resaved_{layout}"
        out = tmp_path / name
        megatron_to_hf(resaved, out, case["hf"])
        ref, got = _load_hf_tensors(Path(case["hf"])), _load_hf_tensors(out)
        assert set(got) == set(ref)
        for k, t in ref.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), f"{name}: {k}"

        def shapes(d):
            md = DcpReader(Path(d) / "release").tensors
            return {k: (tuple(v.size), v.properties.dtype) for k, v in md.items()
                    if hasattr(v, "chunks")}  # fmt: skip

        megatron, ours = (
            DcpReader(resaved / "release"),
            DcpReader(Path(case["torch_dist"]) / "release"),
        )
        assert shapes(resaved) == shapes(case["torch_dist"])
        if layout == "tp2":  # the checkpoint really is split: a TP-sharded key has 2 chunks/layer
            key = "decoder.layers.self_attention.linear_qkv.weight"
            assert len(megatron.tensors[key].chunks) == 2 * len(ours.tensors[key].chunks)


def test_hf_output_loads_without_warnings(conv):
    from transformers import AutoModelForCausalLM

    outputs = [(n, c, Path(c[k])) for n, c in conv["cases"].items() for k in ("hf_from_dist",)]
    outputs += [(n, c, Path(c["hf"]).parent / "hf_from_pp2") for n, c in conv["cases"].items()]
    for name, case, out in outputs:
        _, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
        assert all(not v for v in info.values()), (name, info)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {p.name for p in out.glob("*.safetensors")}
        for f in ("tokenizer.json", "tokenizer_config.json"):
            assert (out / f).read_bytes() == (Path(case["hf"]) / f).read_bytes()
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["vocab_size"] == CASES[name].get("overrides", {}).get("vocab_size", 512)
    assert len(list(outputs[-1][2].glob("*.safetensors"))) > 1  # the 40KB shards


def test_checkpoint_contract_for_pretrain(conv):
    """torch_dist: tracker 'release' + release/, the preset in the common state; legacy:
    iter_0000001/mp_rank_XX[_YYY]/model_optim_rng.pt and tracker '1'."""
    case = conv["cases"]["qwen3"]
    dist = Path(case["torch_dist"])
    assert (dist / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert is_hf_dir(case["hf"]) and not is_hf_dir(dist)
    common = torch.load(dist / "release" / "common.pt", weights_only=True)
    assert common["iteration"] == 0 and common["checkpoint_version"] == 3.0
    preset = read_model(dist)
    assert preset.vocab_size == 512 and preset.qk_layernorm and preset.kv_channels == 32
    assert preset.tie_embeddings
    legacy = Path(case["legacy_tp2pp2"])
    assert (legacy / "latest_checkpointed_iteration.txt").read_text() == "1"
    ranks = sorted(p.name for p in (legacy / "iter_0000001").iterdir())
    assert ranks == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert read_model(legacy) == preset
    assert sorted(
        p.name for p in (Path(conv["cases"]["llama2"]["legacy_tp2"]) / "iter_0000001").iterdir()
    ) == ["mp_rank_00", "mp_rank_01"]


def test_cli_verify(conv):
    res = conv["tp1"]["mistral"]
    assert res["rc"] == 0, res["stdout"]
    assert "verify max-abs logits difference" in res["stdout"]
