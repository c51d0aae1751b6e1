"""Features manager, `anyspeed features`, and one-line errors for bad input before start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from anyspeed import features as F
from anyspeed.device import detect

PY = sys.executable


def run(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {}))
    )


def adaptor_with(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Import the one line in a fresh interpreter with ``argv`` as its command line."""
    code = "import sys, torch; import anyspeed.megatron_adaptor; print('APPLIED')"
    return run(PY, "-c", code, *argv, env=env)


def error_in_process(argv: list[str], capsys, monkeypatch, world: str | None = None) -> str:
    """The shim's check for ``argv`` run in this process (the shim itself is run in a fresh
    interpreter by test_features_flags): exit status 2 and one ``anyspeed: error:`` line,
    raised by validation before anything is patched or any process group exists."""
    from anyspeed.adaptor import apply_command_line, state, undo

    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    fresh = state() is None
    before = [] if fresh else list(state().applied)
    with pytest.raises(SystemExit) as exc:
        apply_command_line(argv)
    assert exc.value.code == 2
    assert (list(state().applied) if state() is not None else []) == before  # nothing applied
    if fresh:
        undo()  # leave the adaptor as the test found it (not yet applied)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("anyspeed: error:")]
    assert len(lines) == 1
    return lines[0]


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("anyspeed: error:")]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_levels_and_registry():
    args = F.parse_args(["--optimization-level", "0"])
    assert args.optimization_level == 0
    assert F.parse_args([]).optimization_level == 2
    names = [f.name for f in F.features()]
    for expected in (
        "device-compat",
        "megatron-core-compat",
        "cuda-only-options",
        "layout-check",
        "megatron-lm-args",
        "megatron-lm-compat",
    ):
        assert expected in names


@pytest.mark.slow  # 13 s; the registry and level tests stay in CI
def test_features_command_lists_features_and_patches():
    out = run(PY, "-m", "anyspeed.cli", "features", "--json", "--optimization-level", "0")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["device"] == detect().type and report["optimization_level"] == 0
    rows = {r["name"]: r for r in report["features"]}
    compat = rows["device-compat"]
    assert compat["on"] and compat["available"] and compat["level"] == 0
    targets = {p["target"] for p in compat["patches"]}
    assert {
        "torch.cuda.current_device",
        "torch.distributed.init_process_group",
        "torch.Tensor.cuda",
    } <= targets
    assert all(p["reason"] for p in compat["patches"])
    from anyspeed.features.compat.megatron_lm_steps import megatron_lm_available

    assert rows["megatron-lm-compat"]["available"] == megatron_lm_available()
    assert rows["megatron-lm-compat"]["on"] == (megatron_lm_available() and detect().type != "cuda")
    text = run(PY, "-m", "anyspeed.cli", "features")
    assert text.returncode == 0 and "device-compat" in text.stdout


def test_one_line_import_is_idempotent():
    code = (
        "import torch; import anyspeed.megatron_adaptor as a; n = len(a.state().manager."
        "patches()); import importlib; a.apply(); a.apply(); "
        "print(n == len(a.state().manager.patches()), torch.zeros(1, device='cuda').device)"
    )
    out = run(PY, "-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("True cpu")


def test_unknown_optimization_level():
    line = one_line_error(adaptor_with("--optimization-level", "5"))
    assert "--optimization-level must be 0, 1 or 2" in line


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine"),
        (["--enable-cuda-graph"], "--enable-cuda-graph"),
    ],
)
def test_feature_flag_unavailable_on_this_device(argv, flag, capsys, monkeypatch):
    if detect().is_cuda:
        pytest.skip("these flags are available on CUDA")
    line = error_in_process(argv, capsys, monkeypatch)
    assert flag in line and detect().type in line


@pytest.mark.parametrize(
    "argv,world,needle",
    [
        (["--tensor-model-parallel-size", "3"], "2", "world size 2 is not divisible"),
        (
            ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
            "2",
            "is not divisible",
        ),
        (
            ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3"],
            "2",
            "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers", "3"],
            "2",
            "--num-layers 3 is not divisible",
        ),
        (
            ["--context-parallel-size", "2", "--seq-length", "30"],
            "2",
            "--seq-length 30 is not divisible by 2 x --context-parallel-size 2",
        ),
        (
            [
                "--context-parallel-size",
                "2",
                "--context-parallel-algo",
                "ulysses_cp_algo",
                "--num-attention-heads",
                "6",
                "--tensor-model-parallel-size",
                "2",
            ],
            "4",
            "--num-attention-heads 6 is not divisible by the Ulysses degree 2",
        ),
        (
            ["--context-parallel-size", "2", "--optimization-level", "1"],
            "2",
            "--context-parallel-size needs --optimization-level 2",
        ),
        (
            ["--context-parallel-size", "2", "--context-parallel-algo", "magic"],
            "2",
            "--context-parallel-algo magic",
        ),
        (
            ["--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo"],
            "4",
            "hybrid_cp_algo needs --ulysses-degree-in-cp dividing --context-parallel-size 4",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--context-parallel-algo",
                "hybrid_cp_algo",
                "--ulysses-degree-in-cp",
                "3",
            ],
            "4",
            "(got 3)",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--context-parallel-algo",
                "hybrid_cp_algo",
                "--ulysses-degree-in-cp",
                "4",
                "--num-attention-heads",
                "6",
            ],
            "4",
            "--num-attention-heads 6 is not divisible by the Ulysses degree 4",
        ),
        (
            ["--context-parallel-size", "2", "--cp-attention-mask-type", "general"],
            "2",
            "--cp-attention-mask-type general: anyspeed's context parallelism computes causal",
        ),
        (
            ["--context-parallel-size", "2", "--ulysses-degree-in-cp", "2"],
            "2",
            "--ulysses-degree-in-cp applies to --context-parallel-algo hybrid_cp_algo only",
        ),
    ],
)
def test_bad_layout_stops_before_process_groups(argv, world, needle, capsys, monkeypatch):
    t0 = time.monotonic()
    line = error_in_process(argv, capsys, monkeypatch, world=world)
    assert needle in line
    assert time.monotonic() - t0 < 60
