"""``anyspeed memory`` as a command, and the memory flags' one-line errors (no processes)."""

from __future__ import annotations

import re

import pytest

from anyspeed.commands import memory
from anyspeed.device import detect
from anyspeed.errors import UsageError
from anyspeed.features import FeatureError, parse_args, validate
from anyspeed.models.recompute import Recompute

BASE = ["--model", "qwen2.5-0.5b", "--seq-length", "4096", "--micro-batch-size", "1", "--bf16"]


def _gib(text: str, row: str) -> float:
    return float(re.search(rf"{row}.*?([0-9.]+) GiB$", text, re.M).group(1))  # the row's last


def test_report_rows_add_up_and_features_lower_activations():
    plain = memory.run(BASE + ["--tensor-model-parallel-size", "2"])
    parts = [_gib(plain, r) for r in ("parameters", "gradients", "optimizer state",
                                      r"activations \(")]  # fmt: skip
    main = float(re.search(r"([0-9.]+) GiB fp32 copies", plain).group(1))
    assert main == pytest.approx(2 * parts[0], rel=1e-3)  # bf16 buffer -> fp32 for the update
    assert _gib(plain, "total") == pytest.approx(sum(parts) - main, abs=2e-3)
    # bf16 Adam: 2-byte weights and gradients, 12 bytes of optimizer state per parameter
    assert parts[2] == pytest.approx(6 * parts[0], rel=1e-3)
    flags = ["--recompute-activation-function", "--recompute-norm"]
    lower = memory.run(BASE + ["--tensor-model-parallel-size", "2", *flags])
    assert _gib(lower, r"activations \(") < parts[3]
    dist = memory.run(BASE + ["--world-size", "4", "--use-distributed-optimizer"])
    assert _gib(dist, "optimizer state") == pytest.approx(_gib(plain, "optimizer state") * 2 / 4,
                                                          rel=1e-2)  # fmt: skip


def test_fits_lists_only_layouts_within_the_budget():
    text = memory.run(BASE + ["--world-size", "4", "--global-batch-size", "8",
                                      "--fits", "6"])  # fmt: skip
    rows = [line.split() for line in text.splitlines()[2:]]
    assert rows and all(float(r[-1]) <= 6 for r in rows)
    assert {r[5] for r in rows} <= set(memory.RECOMPUTE_CHOICES)
    assert "no layout" in memory.run(BASE + ["--world-size", "2", "--fits", "0.01"])


@pytest.mark.parametrize("argv,needle", [
    (BASE + ["--fits", "lots"], "--fits must be a positive, finite number"),
    (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
      "--seq-length", "32"], "no vocabulary size"),
    (BASE + ["--recompute-granularity", "full"], "--recompute-method"),
    (BASE + ["--num-experts", "4", "--expert-model-parallel-size", "3"], "not divisible"),
])  # fmt: skip
def test_bad_input_is_one_line(argv, needle):
    with pytest.raises(UsageError) as err:
        memory.run(argv)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert memory.main(argv) == 2


@pytest.mark.parametrize("rec,needle", [
    (Recompute(method="block"), "need --recompute-granularity"),
    (Recompute(granularity="full", method="uniform", num_layers=9), "between 1 and"),
    (Recompute(granularity="selective", num_layers=1), "are for --recompute-granularity full"),
    (Recompute(granularity="selective", distribute_saved_activations=True), "sequence-parallel"),
])  # fmt: skip
def test_recompute_flag_errors(rec, needle):
    with pytest.raises(ValueError, match=needle):
        rec.check(layers_per_stage=4, sequence_parallel=True)


@pytest.mark.parametrize("argv,needle", [
    (["--recompute-norm-num-layers", "2"], "needs --recompute-norm"),
    (["--recompute-activation-function", "--recompute-activation-function-num-layers", "0"],
     ">= 1"),
    (["--swap-attention", "--swap-modules", "mlp"], "--swap-modules"),
    (["--recompute-norm", "--optimization-level", "1"], "--optimization-level 2"),
])  # fmt: skip
def test_feature_flag_errors(argv, needle):
    with pytest.raises(FeatureError, match=needle):
        validate(parse_args(argv), detect())


def test_moe_experts_split_over_ep():
    moe = BASE + ["--num-experts", "8", "--world-size", "2"]
    one = memory.run(moe)
    two = memory.run(moe + ["--expert-model-parallel-size", "2"])
    assert _gib(two, "parameters") < _gib(one, "parameters")
    assert _gib(two, "total") < _gib(one, "total")
    fits = memory.run(moe + ["--global-batch-size", "8", "--fits", "1000"])
    assert {r.split()[3] for r in fits.splitlines()[2:]} == {"1", "2"}  # both EP sizes listed


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_fits_must_be_a_positive_finite_number(value):
    """``--fits nan`` used to pass every layout and exit 0 (issue 43, item 11)."""
    with pytest.raises(UsageError, match="--fits must be a positive, finite number"):
        memory.run(BASE + ["--fits", value])


@pytest.mark.parametrize("preset", ["qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b",
                                    "deepseek-v3.2", "kimi-k2", "glm-4.5"])  # fmt: skip
def test_the_newer_families_are_estimated(preset):
    """One rank holds the whole model: its parameter row is the preset's count (transformers',
    tests/models/test_presets.py) in bf16, the multi-token prediction layers left out."""
    from anyspeed.models import get_preset

    model = get_preset(preset)
    text = memory.run(["--model", preset, "--seq-length", "4096", "--micro-batch-size", "1",
                       "--bf16"])  # fmt: skip
    want = (model.num_parameters() - model.mtp_parameters()) * 2 / 2**30
    assert _gib(text, "parameters") == pytest.approx(want, abs=1e-3)
    assert _gib(text, r"activations \(") > 0
