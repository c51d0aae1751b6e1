"""``--reuse-fp32-param``: bf16 training with masters held as bf16 weight + 16-bit residual must
equal Megatron's regular fp32-master path bit for bit (losses, grad norms, weights, the masters a
checkpoint saves), with the plain and the distributed optimizer, and hold 2 bytes per parameter
less between steps."""

from __future__ import annotations

import pytest
import torch

from anyspeed.device import detect
from anyspeed.features import registry
from anyspeed.features.base import FeatureError
from anyspeed.features.precision.reuse_fp32 import decode, encode
from anyspeed.testing import run_distributed
from helpers import precision_ranks

STEPS = 5  # the default run; the slow run checks 20 steps
REF, REUSE = ["--bf16"], ["--bf16", "--reuse-fp32-param"]
DISTOPT = dict(distributed_optimizer=True, bucket_size=4000)
LAYOUTS = {"dp2": 0, "dp2-distopt": 2}  # index of the reference run of each pair


def _bits_equal(a: list, b: list) -> bool:
    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return len(a) == len(b) and all(
        torch.equal(x.view(view[x.dtype]), y.view(view[y.dtype])) for x, y in zip(a, b, strict=True)
    )


def _spawn(steps: int, world: int = 2) -> list[dict]:
    # the distributed case steps its masters 4 KiB at a time (many chunks)
    cases = [
        dict(argv=REF, layout={}, resume=True),
        dict(argv=REUSE, layout={}, resume=True),
        dict(argv=REF, layout=DISTOPT),
        dict(argv=REUSE, layout=DISTOPT, chunk_bytes=4096),
    ]
    return run_distributed(
        precision_ranks.rank_checks, world, cases=cases, steps=steps, timeout=600
    )


@pytest.fixture(scope="module")
def dp2_ranks():
    return _spawn(STEPS)


@pytest.fixture(scope="module")
def dp2_runs(dp2_ranks):
    return [r["reuse"] for r in dp2_ranks]


def _assert_bitwise(runs: list[list[dict]], first: int, steps: int) -> None:
    for rank in runs:
        ref, got = rank[first], rank[first + 1]
        assert ref["dtype"] == got["dtype"] == {"torch.bfloat16"}
        assert all(got["ok"]) and len(got["loss"]) == steps
        assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"]
        assert len(set(ref["loss"])) == steps  # training moved
        assert _bits_equal(ref["weights"], got["weights"])
        assert _bits_equal(ref["masters"], got["masters"])


@pytest.mark.slow  # one DP=2 process group: kept out of CI's time budget
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bitwise_equal_to_fp32_masters(dp2_runs, layout):
    _assert_bitwise(dp2_runs, LAYOUTS[layout], STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_bitwise_equal_over_20_steps(world):
    runs = [r["reuse"] for r in _spawn(20, world)]
    for first in LAYOUTS.values():
        _assert_bitwise(runs, first, 20)


@pytest.mark.slow  # one DP=2 process group: kept out of CI's time budget
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_bytes_per_parameter_less(dp2_runs, layout):
    first = LAYOUTS[layout]
    dp = 2 if first else 1
    for rank in dp2_runs:
        ref, got = rank[first], rank[first + 1]
        masters = ref["params"] * 4 // dp  # fp32 masters of this rank (its shard with dist-opt)
        assert abs(ref["held"]["masters"] - masters) <= 4 * dp * 64  # shard padding
        assert got["held"]["masters"] == 0
        # the residual is 2 bytes per master element (+ 8 per rare round-down tie)
        assert got["held"]["residual"] == pytest.approx(ref["held"]["masters"] / 2, rel=1e-3)


@pytest.mark.slow  # one DP=2 process group: kept out of CI's time budget
def test_checkpointed_masters_load_back(dp2_runs):
    """The optimizer state saved and loaded back, training continues as on the regular path."""
    for rank in dp2_runs:
        assert len(rank[1]["after_load"]) == 2
        assert rank[1]["after_load"] == rank[0]["after_load"]


def test_residual_round_trip_is_exact_with_ties():
    """Every rounding case, ties to even both ways, signs, zero, inf and fp32 max."""
    base = torch.randn(4096) * torch.logspace(-30, 30, 4096)
    bits = base.view(torch.int32) & ~0xFFFF
    ties = (bits | 0x8000).view(torch.float32)  # exactly half-way: even and odd uppers
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4028235e38, -1e-45])
    master = torch.cat([base, ties, special])
    model = torch.empty_like(master, dtype=torch.bfloat16)
    residual, tie_idx = encode(master.clone(), model)
    assert torch.equal(model.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    assert tie_idx.numel() > 0 and residual.dtype == torch.int16
    out = torch.empty_like(master)
    decode(model, residual, tie_idx, out)
    assert torch.equal(out.view(torch.int32), master.view(torch.int32))


def test_needs_bf16():
    args = registry.parse_args(["--reuse-fp32-param"])
    with pytest.raises(FeatureError, match="--reuse-fp32-param needs --bf16"):
        registry.validate(args, detect())


@pytest.mark.slow  # one DP=2 process group: kept out of CI's time budget
def test_attention_dropout_in_megatrons_rng_fork(dp2_ranks):
    """SDPAttention with dropout on the CPU runs the blocked kernel with a seed drawn inside
    Megatron's model-parallel RNG fork: equal to math attention with that seed's mask, the
    tracker advanced, and the same mask on both DP ranks (they share the model-parallel RNG)."""
    got = [r["attention"] for r in dp2_ranks]
    assert all(g["diff"] < 1e-5 and g["advanced"] for g in got)
    assert got[0]["seed"] == got[1]["seed"]
