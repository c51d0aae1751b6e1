"""``benchmarks/gpu.py`` (issue 49's GPU training benchmark) runs end to end on this machine in
its dry mode, so it cannot rot before a GPU is at hand; and its MFU by Megatron's FLOPs formula
is Megatron's FLOPs per iteration over each row's time and peak."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_a_row_per_level(capsys):
    lines = _load().main(["--dry", "--iters", "3"])
    assert [ln.split()[2] for ln in lines[:3]] == ["0", "1", "2"]
    for line in lines[:3]:
        tokens = float(line.split()[3])
        # MFU by anyspeed's FLOPs, or n/a where this CPU's bf16 peak could not be measured
        # (a machine busy with other tests)
        assert tokens > 0 and ("anyspeed's FLOPs" in line or "MFU   n/a" in line), line
    assert lines[3].startswith("megatron local") and "skipped" in lines[3]
    # levels 0 and 2 also profiled their one untimed step (3 // 2 = 1), each printed after
    # its row; level 1 did not
    printed = capsys.readouterr().out.splitlines()
    for level, profiled in ((0, True), (1, False), (2, True)):
        after = printed[printed.index(lines[level]) + 1]
        found = re.match(
            rf"  level {level} profile of steps 1-1 on rank 0: [\d.]+ ms of ops \(CPU self "
            r"time\) per step, matrix products [\d.]+% of it; top: ",
            after,
        )
        assert bool(found) == profiled, printed


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


def test_a_failed_row_is_one_line_and_the_others_still_print(capsys):
    """A row whose program fails, runs past its time or prints no iteration reports one line;
    the script goes on with the other rows."""
    import sys

    bench = _load()
    failed = bench._run("x", [sys.executable, "-c", "import sys; sys.exit('boom')"], 60, 0)
    assert failed == {"error": "exit 1: boom"}
    slow = bench._run("x", [sys.executable, "-c", "import time; time.sleep(30)"], 1, 0)
    assert slow == {"error": "ran past --row-timeout 1 s"}
    silent = bench._run("x", [sys.executable, "-c", "print('hello')"], 60, 0)
    assert silent["error"].startswith("no iteration lines")
    assert bench.line("anyspeed level 2", failed, None) == "anyspeed level 2 failed: exit 1: boom"


def test_megatrons_row_runs_first_and_gets_the_peak_of_anyspeeds_rows(monkeypatch, capsys):
    """Megatron's line gives TFLOP/s, not MFU: its MFU is its TFLOP/s over the peak that
    anyspeed's rows used (40 TFLOP/s at 20% -> 200), 50 / 200 = 25%; a failed level still
    leaves the other rows' lines."""
    bench = _load()
    order = []
    ref = dict(ms=100.0, tokens=800.0, megatron_tflops=50.0, peak=1.0)
    monkeypatch.setattr(bench, "megatron_row", lambda *a: order.append("megatron") or ref)

    def level(lvl, *a):
        order.append(lvl)
        if lvl == 1:
            return {"error": "exit 1: out of memory"}
        return dict(ms=80.0, tokens=1000.0, tflops=40.0, mfu=20.0, peak=1.0)

    monkeypatch.setattr(bench, "anyspeed_row", level)
    lines = bench.main(["--levels", "0", "1", "2"])
    assert order == ["megatron", 0, 1, 2]
    assert "failed: exit 1: out of memory" in lines[1]
    assert float(lines[0].split("MFU")[1].split("%")[0]) == pytest.approx(31.2, abs=0.1)
    assert lines[3].startswith("megatron local")
    assert float(lines[3].split("MFU")[1].split("%")[0]) == pytest.approx(25.0, abs=0.1)
    assert capsys.readouterr().out.splitlines() == lines  # each printed as its row ended


SCRIPT_PROBE = """
import sys
import sibling  # a module beside the script, as pretrain_gpt.py imports gpt_builders
import megatron.core.datasets.utils as utils
print(sys.argv[1:], sibling.NAME, utils.compile_helpers.__name__)
"""


def test_megatron_wrapper_runs_the_script_as_python_does(tmp_path) -> None:  # noqa: ANN001
    """``benchmarks/megatron_pretrain.py`` runs the script it is given with the same arguments
    and imports as ``python script.py`` would; where Megatron's compiled dataset helpers import
    (they do here), their rebuild is the only thing it leaves out."""
    import subprocess
    import sys

    (tmp_path / "script.py").write_text(SCRIPT_PROBE)
    (tmp_path / "sibling.py").write_text("NAME = 'beside'\n")
    wrapper = SCRIPT.parent / "megatron_pretrain.py"
    args = ["--num-layers", "2", "--mock-data"]
    runs = [
        [sys.executable, "-W", "ignore", str(tmp_path / "script.py"), *args],
        [sys.executable, "-W", "ignore", str(wrapper), str(tmp_path / "script.py"), *args],
    ]
    outs = [subprocess.run(cmd, capture_output=True, text=True, timeout=120) for cmd in runs]
    assert all(o.returncode == 0 for o in outs), [o.stderr[-1500:] for o in outs]
    direct, wrapped = (o.stdout.strip().rsplit(" ", 1) for o in outs)
    assert direct[0] == wrapped[0] == "['--num-layers', '2', '--mock-data'] beside"
    assert (direct[1], wrapped[1]) == ("compile_helpers", "<lambda>")


def test_dry_run_fp8_row_follows_its_level():
    lines = _load().main(
        ["--dry", "--iters", "3", "--levels", "2", "--fp8-recipe", "tensorwise",
         "--no-megatron", "--profile-levels"]
    )  # fmt: skip
    assert [ln.split()[:4] for ln in lines][1] == ["anyspeed", "level", "2", "fp8"]
    assert len(lines) == 2 and float(lines[1].split()[4]) > 0, lines
