"""Megatron-LM's own pretrain_gpt.py with the one added line, on CPU processes.

Needs a Megatron-LM checkout at tag core_v0.16.1: set ANYSPEED_MEGATRON_LM to its path (see
README). Skipped when absent. The test copies pretrain_gpt.py to a temporary folder and inserts
``import anyspeed.megatron_adaptor`` after ``import torch`` -- the one line a user adds -- and
runs the usual torchrun command, ``--distributed-backend nccl`` included.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

MLM = os.environ.get("ANYSPEED_MEGATRON_LM")
pytestmark = [
    pytest.mark.megatron_lm,
    pytest.mark.skipif(
        not MLM or not Path(MLM, "pretrain_gpt.py").is_file(),
        reason="set ANYSPEED_MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1)",
    ),
]

COMMON = [
    "--distributed-backend",
    "nccl",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "256",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-decay-iters",
    "30",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "255",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--split",
    "100,0,0",
    "--seed",
    "1234",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)")


def add_one_line(dst: Path) -> Path:
    src = Path(MLM, "pretrain_gpt.py").read_text().splitlines()
    i = next(i for i, line in enumerate(src) if line.strip() == "import torch")
    src.insert(i + 1, "import anyspeed.megatron_adaptor")
    path = dst / "pretrain_gpt.py"
    path.write_text("\n".join(src) + "\n")
    return path


def torchrun(script: Path, *args: str, timeout: int = 400, nproc: int = 2) -> dict[int, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MLM, os.environ.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(script),
        *COMMON,
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(out)}


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    return add_one_line(tmp_path_factory.mktemp("mlm"))


@pytest.mark.parametrize(
    "layout",
    [
        # anyspeed's own flags go through Megatron-LM's parser too.
        ["--tensor-model-parallel-size", "2", "--optimization-level", "1", "--use-fused-swiglu"],
        ["--pipeline-model-parallel-size", "2"],
    ],
)
def test_pretrain_gpt_trains_20_iterations(script, layout):
    losses = torchrun(script, *layout, "--train-iters", "20")
    assert sorted(losses) == list(range(1, 21))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[20] < losses[1] - 0.3, losses


def test_pretrain_gpt_save_and_resume_continues_exactly(script, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    layout = ["--pipeline-model-parallel-size", "2"]
    # Same schedule length (30) in every run; the first stops after 20 as a job would.
    first = torchrun(
        script,
        *layout,
        "--train-iters",
        "30",
        "--exit-interval",
        "20",
        "--save",
        ckpt,
        "--save-interval",
        "10",
    )
    assert Path(ckpt, "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    resumed = torchrun(
        script,
        *layout,
        "--train-iters",
        "30",
        "--load",
        ckpt,
        "--save",
        ckpt,
        "--save-interval",
        "10",
    )
    straight = torchrun(script, *layout, "--train-iters", "30")
    assert min(resumed) == 21, "resume must continue after iteration 20"
    # Megatron-LM does not reset its loss accumulator after the first logged iteration of a
    # run (training_log: should_reset = not is_first_iteration), so the resumed run's line for
    # iteration 22 is the mean of iterations 21 and 22. Every other line is one iteration.
    expected = dict(straight)
    expected[22] = (straight[21] + straight[22]) / 2
    for it in range(21, 31):
        assert resumed[it] == pytest.approx(expected[it], rel=1e-5), (
            it,
            [resumed[i] for i in range(21, 31)],
            [straight[i] for i in range(21, 31)],
        )
    assert max(first) == 20
    for it in range(1, 21):
        assert first[it] == pytest.approx(straight[it], rel=1e-5)


@pytest.mark.parametrize("algo", ["megatron_cp_algo", "ulysses_cp_algo"])
def test_pretrain_gpt_context_parallel_matches_data_parallel(script, algo):
    """anyspeed's CP inside Megatron-LM: CP=2 losses equal the DP=2 run's (no dropout)."""
    model = ["--train-iters", "5", "--position-embedding-type", "rope", "--swiglu",
             "--normalization", "RMSNorm", "--no-create-attention-mask-in-dataloader",
             "--hidden-dropout", "0", "--attention-dropout", "0"]  # fmt: skip
    dp = torchrun(script, *model)
    cp = torchrun(script, *model, "--context-parallel-size", "2", "--context-parallel-algo", algo)
    assert sorted(cp) == list(range(1, 6))
    for it in range(1, 6):
        assert cp[it] == pytest.approx(dp[it], rel=1e-5), (it, cp, dp)


def test_pretrain_gpt_hybrid_context_parallel_matches_data_parallel(script):
    """hybrid_cp_algo (Ulysses 2 inside, ring 2 across) at CP=4 equals DP=4 in Megatron-LM."""
    model = ["--train-iters", "3", "--position-embedding-type", "rope", "--swiglu",
             "--normalization", "RMSNorm", "--no-create-attention-mask-in-dataloader",
             "--hidden-dropout", "0", "--attention-dropout", "0"]  # fmt: skip
    dp = torchrun(script, *model, nproc=4)
    cp = torchrun(script, *model, "--context-parallel-size", "4", "--context-parallel-algo",
                  "hybrid_cp_algo", "--ulysses-degree-in-cp", "2", nproc=4)  # fmt: skip
    assert sorted(cp) == list(range(1, 4))
    for it in range(1, 4):
        assert cp[it] == pytest.approx(dp[it], rel=1e-5), (it, cp, dp)
