"""On a device without CUDA, Megatron-Core imports with its ``jit_fuser`` left a no-op: its fused
functions are plain functions (no TorchDynamo / Inductor imported for them), which compute the
same values as the formula they implement."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

PROBE = """
import sys, types, torch
import anyspeed.megatron_adaptor
from megatron.core.fusions import fused_bias_swiglu as f
y = torch.randn(4, 10)
a, b = y.chunk(2, -1)
ok = torch.allclose(f.swiglu(y), torch.nn.functional.silu(a) * b, atol=1e-6)
print(isinstance(f.swiglu, types.FunctionType), "torch._dynamo" in sys.modules, ok)
"""


def _torch_itself_imports_dynamo() -> bool:
    """torch 2.6's ``torch.distributed.tensor.parallel`` (which Megatron imports) imports
    TorchDynamo by itself; there only the plain functions can be checked."""
    probe = "import sys, torch.distributed.tensor.parallel; print('torch._dynamo' in sys.modules)"
    cmd = [sys.executable, "-W", "ignore", "-c", probe]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return out.stdout.split() == ["True"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA Megatron keeps torch.compile")
def test_megatron_imports_without_torch_compile_off_cuda() -> None:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    plain, dynamo, same = out.stdout.split()
    assert (plain, same) == ("True", "True"), out.stdout
    assert dynamo == "False" or _torch_itself_imports_dynamo(), out.stdout


def test_too_late_once_megatron_imported() -> None:
    """After ``megatron.core`` has imported its decorations are done: nothing is installed."""
    import megatron.core  # noqa: F401

    from anyspeed.device.jit import _AfterJit, keep_megatron_jit_off

    assert keep_megatron_jit_off() is False
    assert not any(isinstance(f, _AfterJit) for f in sys.meta_path)


COMPILE = """
import torch
import anyspeed.megatron_adaptor
def f(x, w):
    return torch.nn.functional.silu(x) * w + x.pow(2).mean(-1, keepdim=True)
torch.manual_seed(0)
x, w = torch.randn(8, 32), torch.randn(32)
shim = type(torch.cuda.get_device_properties(0)).__name__
print(shim, torch.allclose(torch.compile(f)(x, w), f(x, w), atol=1e-6))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for torch.cuda only")
def test_torch_compile_runs_under_the_cpu_stand_in(tmp_path) -> None:  # noqa: ANN001
    """A user's ``torch.compile`` on the CPU works with anyspeed's stand-in for ``torch.cuda``
    (Inductor reads the device's properties for its cache key; it crashed on a missing one).
    Inductor's cache is the test's own: a kernel cached by another run (one under another
    ``ATEN_CPU_CAPABILITY`` gave NaN here) must not decide the result."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", COMPILE], capture_output=True,
                         text=True, timeout=300, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["SimpleNamespace", "True"], out.stdout


CLI_PROBE = """
import sys, types
sys.path.insert(0, sys.argv[1])
from anyspeed import cli
rc = cli._run("probe_command")([])  # how `anyspeed <command>` runs a command's module
from megatron.core.fusions import fused_bias_swiglu as f
plain = isinstance(f.swiglu, types.FunctionType) and not hasattr(f.swiglu, "__wrapped__")
print(rc, plain, "torch._dynamo" in sys.modules)  # torch.compile wraps it (functools.wraps)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA Megatron keeps torch.compile")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_command_that_imports_megatron_first_keeps_its_jit_off(tmp_path, device) -> None:  # noqa: ANN001
    """A command whose module imports Megatron-Core before any adaptor is applied (as
    ``convert`` and the data checks of ``pretrain`` do) still gets the no-op decorator; where
    the device is CUDA (forced here by ``ANYSPEED_DEVICE``), Megatron keeps torch.compile."""
    (tmp_path / "probe_command.py").write_text(
        "import megatron.core.models.gpt  # noqa: F401\n\n\ndef main(argv):\n    return 0\n"
    )
    env = dict(os.environ, ANYSPEED_DEVICE=device)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", CLI_PROBE, str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    off = device == "cpu"
    rc, plain, dynamo = out.stdout.split()
    assert (rc, plain) == ("0", str(off)), out.stdout
    assert dynamo == str(not off) or (off and _torch_itself_imports_dynamo()), out.stdout
