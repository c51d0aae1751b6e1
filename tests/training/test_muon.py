"""``--optimizer muon``: Megatron-Core's own Muon, run through anyspeed's stand-in for
``emerging_optimizers`` where that package does not import.

One step at TP1 equals ``torch.optim.Muon`` on every 2-D hidden weight (same coefficients,
same lr adjustment, QKV whole) and ``torch.optim.AdamW`` on the rest; tensor-parallel Muon in
Megatron's duplicated and distributed modes and DP2 equal TP1 over 4 steps (float32
Newton-Schulz); a run saved and resumed equals one straight run; what Megatron's Muon does not
support is one line before start.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from anyspeed.commands.train import pretrain as main
from anyspeed.testing import run_distributed
from helpers import muon_ranks


@pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"),
    reason="the reference, torch.optim.Muon, is absent (torch 2.6)",
)
def test_one_step_equals_torch_muon_and_adamw() -> None:
    muon = dict(momentum=0.9, coefficient_type="simple", scale_mode="shape_scaling",
                use_nesterov=True, split_qkv=False)  # fmt: skip
    (got,) = run_distributed(muon_ranks.one_step_against_torch, 1, muon=muon, timeout=200)
    assert len(got["muon_names"]) == 8  # qkv, proj, fc1, fc2 of both layers
    assert got["muon"] <= 1e-6 and got["adam"] <= 1e-6
    assert got["moved"] > 1e-2  # the step did move the weights


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--fp16"], "--fp16 is not supported (Megatron-Core's Muon refuses it)"),
        (["--use-distributed-optimizer"], "--optimizer dist_muon"),
        (["--muon-coefficient-type", "polar_express"], "a multiple of 8, not 5"),
        (["--muon-momentum", "1.5"], "--muon-momentum"),
        (["--bf16"], "first loss differs"),
        (["--save", "/tmp/anyspeed-never-written"], "cannot save fp32 state"),
    ],
)
def test_unsupported_muon_settings_are_one_line(capsys, extra, says) -> None:
    optimizer = "dist_muon" if extra[0] in ("--bf16", "--save") else "muon"
    argv = ["--model", "tiny-qwen2.5", "--mock-data", "--lr", "0.01", "--train-iters", "1",
            "--optimizer", optimizer, "--seq-length", "64", "--global-batch-size", "4",
            "--micro-batch-size", "2", *extra]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


FP32_NS = dict(momentum=0.9, fp32_matmul_prec="high", use_nesterov=True)


@pytest.mark.slow
def test_tensor_and_data_parallel_muon_equal_one_process(tmp_path) -> None:
    init = str(tmp_path / "init")
    (want,) = run_distributed(muon_ranks.muon_steps, 1, layout={}, muon=FP32_NS, save_init=init,
                              timeout=300)  # fmt: skip
    cases = {
        "tp2-duplicated": ({"tp": 2}, dict(FP32_NS, tp_mode="duplicated")),
        "tp2-distributed": ({"tp": 2}, dict(FP32_NS, tp_mode="distributed")),
        "tp2-distributed-whole-qkv": (
            {"tp": 2},
            dict(FP32_NS, tp_mode="distributed", split_qkv=False),
        ),  # fmt: skip
        "dp2": ({}, FP32_NS),
        "dp2-dist_muon": ({}, FP32_NS),
    }
    for name, (layout, muon) in cases.items():
        opt = "dist_muon" if "dist_muon" in name else "muon"
        got = run_distributed(muon_ranks.muon_steps, 2, layout=layout, muon=muon, load=init,
                              optimizer=opt, timeout=300)[0]  # fmt: skip
        if name == "tp2-distributed-whole-qkv":
            continue  # another update (QKV orthogonalised whole): it only has to run
        for w, g in zip(want, got, strict=True):
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), name
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), name


@pytest.mark.slow
def test_expert_parallel_muon_equals_one_process(tmp_path) -> None:
    """EP2: each rank's experts get a Muon of their own (the expert group), as Megatron builds."""
    init, moe = str(tmp_path / "init"), muon_ranks.MOE
    (want,) = run_distributed(muon_ranks.muon_steps, 1, layout={}, muon=FP32_NS, save_init=init,
                              model=moe, timeout=300)  # fmt: skip
    got = run_distributed(muon_ranks.muon_steps, 2, layout={"ep": 2}, muon=FP32_NS, load=init,
                          model=moe, timeout=300)[0]  # fmt: skip
    for w, g in zip(want, got, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_saved_and_resumed_equals_straight(tmp_path) -> None:
    base = [sys.executable, "-m", "anyspeed", "pretrain", "--model", "tiny-qwen2.5", "--mock-data",
            "--lr", "0.01", "--lr-decay-style", "constant", "--optimizer", "muon",
            "--log-interval", "1", "--seq-length", "64", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--train-iters", "4"]  # fmt: skip
    env = dict(os.environ, PYTHONWARNINGS="ignore")

    def losses(*extra: str) -> list[str]:
        out = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        lines = [x for x in out.stdout.splitlines() if x.startswith(" iteration")]
        return [x.split("lm loss:")[1].split("|")[0] + x.split("grad norm:")[1].split("|")[0]
                for x in lines]  # fmt: skip

    straight = losses()
    ck = str(tmp_path / "ck")
    losses("--save", ck, "--exit-interval", "2")
    resumed = losses("--load", ck)
    assert resumed == straight[2:]
