"""``--swap-attention`` on CUDA (skipped without a GPU) and the first-step report of
``anyspeed pretrain`` (slow: one training process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from helpers.memory_cases import run_cases

SWAP = ["--swap-attention"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="swap-attention is real on CUDA only")
def test_swap_attention_on_cuda_lowers_peak_with_equal_losses():
    cfg = dict(seq_length=512, micro_batch_size=4, global_batch_size=4)
    model = dict(num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=8)
    runs = run_cases(1, {}, {"none": {}, "swap": dict(argv=SWAP)}, model=model, **cfg)
    none, swap = runs["none"][0], runs["swap"][0]
    assert swap["loss"] == none["loss"] and swap["grad_norm"] == none["grad_norm"]
    # the swapped tensors leave the device: the meter sees them gone, the peak drops as much
    dropped = none["saved_bytes"] - swap["saved_bytes"]
    assert dropped > 0
    assert none["device_peak"] - swap["device_peak"] >= 0.5 * dropped


@pytest.mark.slow
def test_pretrain_reports_saved_bytes_at_the_first_step():
    argv = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
            "4", "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
            "--eval-iters", "0", "--no-progress-bar"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

    def saved(extra: list[str]) -> float:
        out = subprocess.run([sys.executable, "-m", "anyspeed", "pretrain", *argv, *extra],
                             capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        line = re.search(r"saved for backward per micro-batch: ([0-9.]+) MiB", out.stdout)
        assert line, out.stdout
        return float(line.group(1))

    assert saved(["--recompute-activation-function"]) < saved([])
