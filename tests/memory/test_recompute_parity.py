"""Recompute (Megatron's own and anyspeed's activation / norm recompute) and the swap flags:
same losses and grad norms as the run without them over 5 steps, and the bytes autograd saves
for backward drop by exactly what each feature releases (the bytes meter against the formula).

Every case starts from the same weights (same seed, same layout); one process group per world
size runs all its cases. At one process in CI; TP2 + SP, PP2 and MoE experts under -m slow.
"""

from __future__ import annotations

import pytest

from helpers.memory_cases import ACT, CASES, GELU_CASES, MODEL, NORM, run_cases

TOL = 1e-6  # fp32; most cases are bit-equal
F32 = 4
S, B, H, FFN, L = 32, 2, 64, 128, 2  # CFG and MODEL's sizes

SLOW_CASES = {
    **GELU_CASES,
    "full-block": dict(recompute=dict(granularity="full", method="block", num_layers=1)),
    "act-1-layer": dict(argv=ACT + ["--recompute-activation-function-num-layers", "1"]),
    "norm-1-layer": dict(argv=NORM + ["--recompute-norm-num-layers", "1"]),
    "act+full-block": dict(
        argv=ACT, recompute=dict(granularity="full", method="block", num_layers=1)
    ),  # fmt: skip
}
MOE = dict(MODEL, num_experts=4, moe_router_topk=2)
MOE_CASES = {
    "moe-none": dict(model=MOE),
    "moe-act": dict(model=MOE, argv=ACT),
    "moe-grouped-none": dict(model=dict(MOE, moe_grouped_gemm=True)),
    "moe-grouped-act": dict(model=dict(MOE, moe_grouped_gemm=True), argv=ACT),
}


def _same_training(ref: dict, got: dict) -> None:
    for key in ("loss", "grad_norm"):
        assert len(got[key]) == 5
        assert got[key] == pytest.approx(ref[key], rel=TOL, abs=0), key
    assert len({round(x, 9) for x in ref["loss"]}) > 1  # training moved


def _norm_bytes(tp: int = 1) -> int:
    """Per norm, what recompute releases: its output (kept by the next linear) and what
    torch's composite RMSNorm keeps (x * rstd and rstd [tokens]); its input is the residual
    stream, kept anyway. Under sequence parallelism each rank holds 1/tp of the tokens."""
    return (2 * S * B * H + S * B) * F32 // tp


@pytest.mark.parametrize("name", [n for n in CASES if n != "none"])
def test_same_losses_and_grad_norms(one_process, name):
    ref = one_process["gelu-none" if name.startswith("gelu") else "none"][0]
    _same_training(ref, one_process[name][0])


def test_saved_bytes_drop_by_the_formula(one_process):
    saved = {n: r[0]["saved_bytes"] for n, r in one_process.items()}
    act = S * B * FFN * F32  # the SwiGLU output per layer (fc2's input)
    assert saved["none"] - saved["act"] == L * act
    assert saved["none"] - saved["norm"] == L * 2 * _norm_bytes()
    assert saved["none"] - saved["act+norm+swap"] == L * (act + 2 * _norm_bytes())
    # Full recompute keeps only the recomputed layers' inputs: far below the rest.
    assert saved["full-uniform"] < saved["selective"] < saved["none"]


@pytest.mark.slow
@pytest.mark.parametrize("world,layout", [(2, dict(tp=2, sequence_parallel=True)), (2, dict(pp=2))],
                         ids=["tp2-sp", "pp2"])  # fmt: skip
def test_parallel_layouts(world, layout):
    runs = run_cases(world, layout, {**CASES, **SLOW_CASES})
    for name, ranks in runs.items():
        ref = runs["gelu-none" if name.startswith("gelu") else "none"]
        for r, g in zip(ref, ranks, strict=True):
            _same_training(r, g)
    tp = layout.get("tp", 1)
    layers = L // layout.get("pp", 1)  # per rank
    for rank, none in enumerate(runs["none"]):
        act = runs["act"][rank]["saved_bytes"]
        norm = runs["norm"][rank]["saved_bytes"]
        assert none["saved_bytes"] - act == layers * S * B * FFN * F32 // tp
        assert none["saved_bytes"] - norm == layers * 2 * _norm_bytes(tp)
        one = runs["act-1-layer"][rank]["saved_bytes"]  # the first layer of each chunk
        assert none["saved_bytes"] - one == S * B * FFN * F32 // tp


@pytest.mark.slow
def test_one_process_slow_cases():
    runs = run_cases(1, {}, {"none": {}, **SLOW_CASES})
    act = S * B * FFN * F32
    for name, ranks in runs.items():
        _same_training(runs["gelu-none" if name.startswith("gelu") else "none"][0], ranks[0])
    saved = {n: r[0]["saved_bytes"] for n, r in runs.items()}
    assert saved["gelu-none"] - saved["gelu-act"] == L * act  # GeLU keeps only its input
    assert saved["none"] - saved["act-1-layer"] == act
    assert saved["none"] - saved["norm-1-layer"] == 2 * _norm_bytes()


@pytest.mark.slow
def test_moe_experts():
    runs = run_cases(1, {}, MOE_CASES)
    for kind in ("moe", "moe-grouped"):
        _same_training(runs[f"{kind}-none"][0], runs[f"{kind}-act"][0])
        assert runs[f"{kind}-act"][0]["saved_bytes"] < runs[f"{kind}-none"][0]["saved_bytes"]
