"""``--fp8-format`` in training: every layout quantizes the same numbers (amaxes reduced over
the ranks holding parts of a tensor), so TP2 + SP, PP2, VPP, CP2 and the distributed optimizer
train as data parallelism does within FP8's own rounding noise; the run stays within 1% of the
unquantized one but is not it; only the chosen layers are FP8; the input saved for backward is
one byte an element."""

from __future__ import annotations

import pytest

from anyspeed.testing import run_distributed
from helpers import fp8_ranks

STEPS = 3
TW = {"recipe": "tensorwise"}
DELAYED = {"recipe": "delayed"}
MOE = dict(num_experts=4, moe_router_topk=2)
CASES = [  # the first saves the initial weights the others load
    dict(name="ref", meter=True),
    dict(name="dp", fp8=TW, meter=True),
    dict(name="tp", fp8=TW, layout=dict(tp=2, sequence_parallel=True)),
    dict(name="dp-delayed", fp8=DELAYED),
    dict(name="pp", fp8=TW, layout=dict(pp=2)),
    dict(name="cp", fp8=TW, layout=dict(cp=2), argv=["--context-parallel-size", "2"]),
    dict(name="ends", fp8={"recipe": "tensorwise", "bf16_start": 1, "bf16_end": 1}),
    dict(name="bf16-ref", bf16=True),
    dict(name="bf16", fp8=TW, bf16=True),
    dict(name="moe-ref", model=MOE, layout=dict(ep=2), init=False),
    dict(name="moe", fp8=TW, model=MOE, layout=dict(ep=2), init=False),
]
SLOW_CASES = [  # -m slow (CI time)
    dict(name="dp", fp8=TW),
    dict(name="vpp", fp8=TW, layout=dict(pp=2, vpp=2)),
    dict(
        name="distopt",
        fp8=TW,
        layout=dict(distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=4000),
    ),  # fmt: skip
    dict(name="tp-delayed", fp8=DELAYED, layout=dict(tp=2)),
    dict(name="pp-delayed", fp8=DELAYED, layout=dict(pp=2)),
    dict(
        name="recompute", fp8=TW, recompute=dict(granularity="full", method="uniform", num_layers=1)
    ),  # fmt: skip
]


def _spawn(tmp_path_factory, cases: list[dict]) -> dict:
    init = str(tmp_path_factory.mktemp("fp8") / "init")
    return run_distributed(fp8_ranks.runs, 2, cases=cases, steps=STEPS, init=init, timeout=600)[0]


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory):
    return _spawn(tmp_path_factory, CASES)


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    return _spawn(tmp_path_factory, SLOW_CASES)


def _close(a: list[float], b: list[float], rel: float) -> bool:
    return all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b, strict=True))


def test_fp8_trains_near_the_unquantized_run_but_is_not_it(fp8_runs):
    ref, dp = fp8_runs["ref"], fp8_runs["dp"]
    assert ref["fp8_linears"] == 0 and dp["fp8_linears"] == 4 * 4  # 4 layers: qkv, proj, fc1, fc2
    assert _close(dp["loss"], ref["loss"], 1e-3)
    assert _close(dp["grad_norm"], ref["grad_norm"], 0.05)
    assert max(abs(a - b) for a, b in zip(dp["loss"], ref["loss"], strict=True)) > 1e-6


def _same_quantization(got: dict, want: dict) -> None:
    """The first step's loss is the same to 2e-6 (the same quantized operands; only the sums'
    order differs); later steps stay within FP8's rounding noise."""
    assert abs(got["loss"][0] - want["loss"][0]) <= 2e-6 * want["loss"][0]
    assert _close(got["loss"], want["loss"], 5e-5)
    assert _close(got["grad_norm"], want["grad_norm"], 0.01)


@pytest.mark.parametrize("ours", ["tp", "pp", "cp"])
def test_model_parallel_fp8_equals_data_parallel_fp8(fp8_runs, ours):
    _same_quantization(fp8_runs[ours], fp8_runs["dp"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "ours,base", [("vpp", "dp"), ("distopt", "dp"), ("tp-delayed", "pp-delayed")]
)
def test_more_layouts_in_fp8(slow_runs, ours, base):
    """Delayed scaling's history is per call, so its layouts compare where each rank runs the
    same micro-batches in order (TP2 and PP2: one data-parallel rank)."""
    _same_quantization(slow_runs[ours], slow_runs[base])


def test_delayed_scaling_differs_from_tensorwise(fp8_runs):
    assert fp8_runs["dp-delayed"]["loss"][1:] != fp8_runs["dp"]["loss"][1:]


def test_the_start_up_line_says_what_runs_in_fp8(fp8_runs):
    line = fp8_runs["dp"]["line"]
    assert line.startswith("anyspeed pretrain: FP8 GEMMs (hybrid, tensorwise scaling) in 16 ")
    assert "emulated on cpu" in line or "torch._scaled_mm" in line, line


def test_first_and_last_layers_stay_in_high_precision(fp8_runs):
    assert fp8_runs["ends"]["fp8_layers"] == ["1", "2"]
    assert fp8_runs["dp"]["fp8_layers"] == ["0", "1", "2", "3"]


def test_fp8_saves_its_linear_inputs_in_one_byte(fp8_runs):
    """Each of the 16 linears keeps its input in FP8 instead of fp32: the forward saves less."""
    ref, dp = fp8_runs["ref"]["saved"], fp8_runs["dp"]["saved"]
    assert dp < ref * 0.9, (dp, ref)


@pytest.mark.slow
def test_recompute_reproduces_the_quantization_exactly(slow_runs):
    """Tensorwise scales come from the tensors themselves: the recomputed forward quantizes
    what the first one did, so full recompute changes nothing."""
    assert slow_runs["recompute"]["loss"] == slow_runs["dp"]["loss"]
    assert slow_runs["recompute"]["grad_norm"] == slow_runs["dp"]["grad_norm"]


@pytest.mark.parametrize("ours,base", [("bf16", "bf16-ref"), ("moe", "moe-ref")])
def test_bf16_and_moe_train_near_their_unquantized_runs(fp8_runs, ours, base):
    got, want = fp8_runs[ours], fp8_runs[base]
    assert _close(got["loss"], want["loss"], 2e-3) and got["loss"] != want["loss"]


def test_moe_experts_run_fp8(fp8_runs):
    """Per layer: attention's 2 linears and FC1/FC2 of each of the 2 local experts (EP2 of 4)."""
    assert fp8_runs["moe"]["fp8_linears"] == 4 * (2 + 2 * 2)
