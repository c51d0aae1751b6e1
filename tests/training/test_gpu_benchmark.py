"""``benchmarks/gpu.py`` (issue 49's GPU training benchmark) runs end to end on this machine in
its dry mode, so it cannot rot before a GPU is at hand; and its MFU by Megatron's FLOPs formula
is Megatron's FLOPs per iteration over each row's time and peak."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_a_row_per_level():
    lines = _load().main(["--dry", "--iters", "3"])
    assert [ln.split()[2] for ln in lines[:3]] == ["0", "1", "2"]
    for line in lines[:3]:
        tokens = float(line.split()[3])
        assert tokens > 0 and "MFU" in line and "anyspeed's FLOPs" in line
    assert lines[3].startswith("megatron local") and "skipped" in lines[3]


def test_mfu_by_megatrons_flops_where_its_row_ran():
    """Megatron ran 100 ms at 50 TFLOP/s (5 TFLOP per iteration); a row of 80 ms whose own
    TFLOP/s and MFU say a 200 TFLOP/s peak is at 5e12 / 0.08 / 200e12 = 31.25%."""
    bench = _load()
    rows = {
        "anyspeed level 1": dict(ms=80.0, tokens=1000.0, tflops=40.0, mfu=20.0, peak=1.0),
        "megatron local": dict(
            ms=100.0, tokens=800.0, tflops=50.0, mfu=25.0, megatron_tflops=50.0, peak=1.0
        ),  # fmt: skip
    }
    line = bench.table(rows)[0]
    assert "Megatron's FLOPs" in line
    assert float(line.split("MFU")[1].split("%")[0]) == pytest.approx(
        31.25, abs=0.1
    )  # printed to 0.1
