"""``anyspeed convert`` for the MoE families: Mixtral, Qwen1.5/2-MoE (shared expert and its gate,
pre-softmax routing) and Qwen3-MoE (QK norm).

DeepSeek-V2-Lite (multi-latent attention with YaRN RoPE, a dense first layer, always-on shared
experts, an odd number of layers) is checked also at TP2 with sequence parallelism.

Tiny random ``transformers`` models (every weight random, experts included) are converted to
torch_dist and to the legacy layout with experts split over EP ranks
(``--target-expert-parallel-size``). Megatron's GPTModel loads them at EP1 and EP2 (torch_dist
through ``dist_checkpointing.load``, legacy rank files through ``load_state_dict(strict=True)``)
and must give transformers' logits within 1e-4 max-abs (fp32); converting back must reproduce
every HF tensor, every expert's, bit for bit. EP2 x TP2 x PP2 (eight processes) runs with
``-m slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_convert import _check, _load_hf_tensors

from anyspeed.convert import hf_to_megatron, megatron_to_hf
from anyspeed.convert.verify import hf_logits
from anyspeed.testing import run_distributed
from helpers import convert_ranks

# Two process groups: -m slow (test_convert_moe_quick.py runs in CI).
pytestmark = pytest.mark.slow

FAMILIES = {
    "mixtral": "tiny-mixtral",
    "qwen2-moe": "tiny-qwen2-moe",
    "qwen3-moe": "tiny-qwen3-moe",
    "deepseek-v2-lite": "tiny-deepseek-v2-lite",  # MLA + YaRN, dense first layer, 3 layers
}
LEGACY = {"ep2": (1, 1, 2), "ep2-tp2-pp2": (2, 2, 2)}  # (tp, pp, ep)


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_moe")
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(5))
    cases, ref = {}, {}
    for i, (name, preset) in enumerate(FAMILIES.items()):
        d = root / name
        convert_ranks.tiny_hf_model(d / "hf", preset, seed=10 + i)
        ref[name] = hf_logits(d / "hf", tokens)
        case = {"hf": str(d / "hf"), "torch_dist": str(d / "dist"),
                "hf_from_dist": str(d / "hf_from_dist")}  # fmt: skip
        if name == "deepseek-v2-lite":
            case["stages"] = "1,2"  # 3 layers at PP2: uneven stages
        for tag, (tp, pp, ep) in LEGACY.items():  # legacy needs no process group: convert here
            stages = "1,2" if pp == 2 and name == "deepseek-v2-lite" else None  # 3 layers
            hf_to_megatron(d / "hf", d / f"legacy_{tag}", tp=tp, pp=pp, ep=ep,
                           ckpt_format="legacy", num_layer_list=stages)  # fmt: skip
            megatron_to_hf(d / f"legacy_{tag}", d / f"hf_from_{tag}", d / "hf")
            case[f"legacy_{tag}"] = str(d / f"legacy_{tag}")
        cases[name] = case
    ep1 = run_distributed(convert_ranks.convert_all, 1, cases=cases, tokens=tokens,
                          cli_case="qwen3-moe", timeout=300)[0]  # fmt: skip
    with_legacy = {n: dict(c, legacy=c["legacy_ep2"]) for n, c in cases.items()}
    deepseek = {"deepseek-v2-lite": cases["deepseek-v2-lite"]}
    runs = [dict(cases=with_legacy, tp=1, pp=1, ep=2),
            dict(cases=deepseek, tp=2, pp=1, sp=True)]  # fmt: skip
    ranks = run_distributed(convert_ranks.layouts_logits, 2, runs=runs, tokens=tokens,
                            timeout=300)  # fmt: skip
    ep2, tp2_sp = [r[0] for r in ranks], [r[1] for r in ranks]
    return {"root": root, "cases": cases, "ref": ref, "ep1": ep1, "ep2": ep2, "tp2_sp": tp2_sp,
            "tokens": tokens}  # fmt: skip


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers_ep1(conv, name):
    _check(conv["ref"][name], conv["ep1"][name]["dist"])


def test_cli_verify_checks_moe_logits(conv):
    res = conv["ep1"]["qwen3-moe"]
    assert res["rc"] == 0 and "verify" in res["stdout"], res["stdout"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers_ep2(conv, name):
    """torch_dist at EP2 and the legacy EP2 rank files (strict load): both EP ranks compute the
    same logits (the experts are split, the batch is not)."""
    for rank in conv["ep2"]:
        for kind in ("dist", "legacy"):
            _check(conv["ref"][name], rank[name][kind])
        assert rank[name]["shape_mismatch"] == []


def test_deepseek_v2_lite_at_tp2_sequence_parallel(conv):
    for rank in conv["tp2_sp"]:
        _check(conv["ref"]["deepseek-v2-lite"], rank["deepseek-v2-lite"]["dist"])


@pytest.mark.parametrize("source", ["dist", *LEGACY])
def test_round_trip_is_bit_identical(conv, source):
    from transformers import AutoModelForCausalLM

    for name, case in conv["cases"].items():
        ref = _load_hf_tensors(Path(case["hf"]))
        out = Path(case["hf"]).parent / f"hf_from_{source}"
        got = _load_hf_tensors(out)
        assert set(got) == set(ref), name
        assert any(".experts.7." in k for k in ref)  # every expert is compared
        for k, t in ref.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), f"{name}: {k}"
        if source == "dist":
            _, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
            assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.slow  # eight processes
def test_logits_match_transformers_ep2_tp2_pp2(conv):
    cases = {n: dict(c, legacy=c["legacy_ep2-tp2-pp2"]) for n, c in conv["cases"].items()}
    ranks = run_distributed(convert_ranks.layout_logits, 8, cases=cases, tp=2, pp=2, ep=2,
                            tokens=conv["tokens"], timeout=600)  # fmt: skip
    for name in FAMILIES:
        for kind in ("dist", "legacy"):
            _check(conv["ref"][name], ranks[-1][name][kind])
        assert all(r[name]["shape_mismatch"] == [] for r in ranks)
