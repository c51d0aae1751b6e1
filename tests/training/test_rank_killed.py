"""kill -9 of one rank while a job trains and saves: one line naming the rank and the signal
(no gloo or torchrun traceback), exit 1, and the checkpoint the tracker names loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from anyspeed.checkpoint.files import TRACKER

ARGV = ("--model tiny-qwen2.5 --mock-data --vocab-size 512 --seq-length 64 "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 100000 --lr 1e-3 "
        "--no-progress-bar --log-interval 1000 --eval-iters 0").split()  # fmt: skip


def _rank_pid(launcher: psutil.Process, rank: str) -> int | None:
    for p in launcher.children(recursive=True):
        try:
            if p.environ().get("RANK") == rank and "anyspeed" in " ".join(p.cmdline()):
                return p.pid
        except psutil.Error:
            continue
    return None


@pytest.mark.slow
def test_kill_one_rank_during_saves(tmp_path):
    save = str(tmp_path / "ck")
    cmd = [sys.executable, "-m", "anyspeed", "pretrain", *ARGV, "--nproc-per-node", "2",
           "--save", save, "--save-interval", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # saving every step: a kill lands in or near a save
            if "saved checkpoint" in line and "iter_0000003" in line:
                break
        pid = _rank_pid(psutil.Process(proc.pid), "1")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    lines = [x for x in err.strip().splitlines() if "Transformer Engine" not in x]
    assert lines == [
        f"anyspeed pretrain: error: rank 1 (pid {pid}) was killed by SIGKILL; "
        "every rank has stopped (checkpoints already written are complete)"
    ], err
    it = int(open(os.path.join(save, TRACKER)).read())
    resume = list(ARGV)  # one process now
    resume[resume.index("100000")] = str(it + 1)
    out = subprocess.run([sys.executable, "-m", "anyspeed", "pretrain", *resume, "--load", save],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"loaded {save} at iteration {it}" in out.stdout
