"""``benchmarks/ops.py``'s per-kernel table runs on this machine at tiny shapes, so it cannot rot
before a GPU is at hand; the rows it adds on CUDA (level 1's choices against Megatron's
``torch.compile``'d fusions) compare kernels that compute the same values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_kernel_table_runs_at_tiny_shapes() -> None:
    cmd = [
        sys.executable,
        str(BENCH / "ops.py"),
        "--skip-e2e",
        "--shape",
        "tiny",
        "--seq-length",
        "64",
        "--reps",
        "1",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("per kernel"))
    assert "tiny shapes, seq 64, fp32, 1 process on cpu" in lines[at]
    rows = lines[at + 2 :]
    names = [r[:48].strip() for r in rows]
    # no compiled rows off CUDA
    assert names == ["attention (causal, GQA)", "SwiGLU", "RoPE", "cross-entropy (vocab 512)"]
    for row in rows:
        a_ms, b_ms = (float(v) for v in row[48:].split()[:2])
        assert a_ms > 0 and b_ms > 0, row


COMPILED = """
import os, sys
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from megatron.core import parallel_state as ps
ps.initialize_model_parallel()
import ops
torch.manual_seed(0)
x = torch.randn(32, 64, requires_grad=True)
logits = torch.randn(32, 1, 512, requires_grad=True)
labels = torch.randint(0, 512, (32, 1))
rows = ops._compiled_rows(torch.device("cpu"), x, logits, labels)
for name, a, b in rows:
    leaf = x if "SwiGLU" in name else logits
    ya, yb = a(), b()
    ga, = torch.autograd.grad(a().sum(), leaf)
    gb, = torch.autograd.grad(b().sum(), leaf)
    ms = ops._measure(b, 1, torch.device("cpu"))["ms"]
    gap = float((ga - gb.float()).abs().max())
    print(name.split(":")[0], float((ya - yb).abs().max()), gap, str(gb.dtype), ms > 0)
"""


@pytest.mark.slow
def test_the_cuda_rows_compare_kernels_that_agree(tmp_path) -> None:  # noqa: ANN001
    """With Megatron's fusions compiled (its jit_fuser kept on by a forced CUDA device; Inductor
    runs them on CPU tensors here), anyspeed's SwiGLU and cross-entropy give Megatron's values
    and input gradients, and the rows time. Megatron's fused cross-entropy returns its gradient
    in bf16 whatever the logits' dtype, so there the gradients agree to bf16's precision
    (softmax terms below 1: 2^-8), where anyspeed's keeps the logits' fp32."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, ANYSPEED_DEVICE="cuda", TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", COMPILED, str(BENCH), port],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = [line.split() for line in out.stdout.strip().splitlines()]
    assert [g[0] for g in got] == ["SwiGLU", "cross-entropy"]
    (_, values, grads, dtype, timed), (_, ce_values, ce_grads, _, ce_timed) = got
    assert float(values) <= 1e-5 and float(grads) <= 1e-5 and dtype == "torch.float32"
    assert float(ce_values) <= 1e-5 and float(ce_grads) <= 2**-8  # (cast back to fp32 by autograd)
    assert timed == ce_timed == "True"
