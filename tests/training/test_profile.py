"""``anyspeed pretrain --profile``: a Chrome trace of the window's steps and a line with the
ops' time and the matrix products' share, which the trace itself must bear out."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

BASE = ["--model", "tiny-qwen2.5", "--mock-data", "--train-iters", "4", "--lr", "1e-3",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--eval-iters", "0", "--no-progress-bar", "--log-interval", "2"]  # fmt: skip
PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"}


def _pretrain(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "anyspeed", "pretrain", *BASE, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_profile_writes_a_trace_and_the_products_share(tmp_path) -> None:
    out = _pretrain("--profile", "--profile-step-start", "1", "--profile-step-end", "3",
                    "--tensorboard-dir", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "USDT" not in out.stdout + out.stderr  # the profiler's own start/stop lines
    lines = [ln for ln in out.stdout.splitlines() if "profile of steps" in ln]
    assert len(lines) == 1, out.stdout
    m = re.search(r"steps 2-3 on rank 0: ([\d.]+) ms of ops .* matrix products ([\d.]+)% of it",
                  lines[0])  # fmt: skip
    assert m, lines[0]
    total_ms, share = float(m.group(1)), float(m.group(2)) / 100
    trace = json.load(open(tmp_path / "profile_rank0_steps2-3.json"))
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op"]
    # the products are leaf ops on the CPU: their durations in the trace are their self times
    products_ms = sum(e["dur"] for e in ops if e["name"] in PRODUCTS) / 1e3 / 2
    assert products_ms > 0
    assert share * total_ms == pytest.approx(products_ms, rel=0.05, abs=0.05)


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--profile-step-start", "2", "--profile-step-end", "2"],
         "--profile-step-end 2 must be above --profile-step-start 2"),
        (["--profile-ranks", "1", "--profile-step-start", "1"],
         "--profile-ranks 1: the ranks of this run are 0..0"),
        (["--profile-step-start", "-1"], "--profile-step-start"),
        (["--profile-ranks", "-1"], "--profile-ranks"),
        ([], "--profile-step-start 10 is not below --train-iters 4"),  # the default window
    ],
)  # fmt: skip
def test_bad_profile_flags_are_one_line(argv: list[str], error: str) -> None:
    out = _pretrain("--profile", *argv)
    assert out.returncode == 2, out.stdout[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and error in lines[0], out.stderr


def test_a_run_past_the_window_says_so(capsys) -> None:
    """A resumed run that starts after the window profiles nothing and says so at its end."""
    from types import SimpleNamespace

    from anyspeed.training.profile_hook import ProfileHook

    hook = ProfileHook("anyspeed pretrain", 1, 3, None)
    state = SimpleNamespace(start_iteration=5, iteration=5)
    for _ in range(3):  # steps 6-8: before_step sees 5, 6, 7 finished
        hook.before_step(state)
        state.iteration += 1
        hook.after_step(state, {})
    hook.on_end(state, True)
    out = capsys.readouterr().out
    assert "profile: no step in 2-3 ran (this run trained steps 6-8)" in out


def test_device_time_counts_each_kernel_once() -> None:
    """On a device torch's profiler lists each kernel twice: as its own event and inside the
    operator that launched it. The step's total must be the kernels' alone, as torch's own
    table sums it, and the products' share that of their operators. Events laid out as
    torch's kineto reader builds them (a CUDA profile cannot run on this machine)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from anyspeed.training.profile_hook import summarize

    def op(i: int, name: str, start: int, end: int, kernel: tuple | None = None) -> FunctionEvent:
        ev = FunctionEvent(i, name, 0, start, end, use_device="cuda", stack=[])
        if kernel:
            ev.append_kernel(kernel[0], 0, kernel[1])
        return ev

    def kernel(i: int, name: str, start: int, end: int, note: bool = False) -> FunctionEvent:
        return FunctionEvent(
            i,
            name,
            7,
            start,
            end,
            use_device="cuda",
            stack=[],
            device_type=DeviceType.CUDA,
            is_user_annotation=note,
        )

    events = EventList(
        [
            op(1, "aten::linear", 5, 30),
            op(2, "aten::mm", 10, 20, ("sm90_gemm", 300)),
            op(3, "aten::add", 21, 25, ("elementwise", 50)),
            kernel(4, "sm90_gemm", 100, 400),
            kernel(5, "elementwise", 400, 450),
            kernel(6, "a range", 90, 460, note=True),
        ],
        use_device="cuda",
    )
    events._build_tree()
    averages = events.key_averages()
    table = averages.table(sort_by="self_cuda_time_total")
    torch_total = float(re.search(r"Self CUDA time total: ([\d.]+)us", table).group(1))
    mm_share = float(re.search(r"aten::mm(?:\s+\S+){6}\s+([\d.]+)%", table).group(1))
    total, share, ranked = summarize(averages, 2, on_device=True)
    assert total == pytest.approx(torch_total / 1e6 / 2)
    assert share * 100 == pytest.approx(mm_share, abs=0.01)
    assert [k for k, _ in ranked] == ["aten::mm", "aten::add"]  # operators, by their kernels
