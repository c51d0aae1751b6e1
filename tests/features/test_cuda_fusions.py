"""``fused-swiglu`` on CUDA keeps Megatron-Core's own fused SwiGLU, which ``torch.compile``
fuses there (one kernel each way), instead of anyspeed's eager one (several passes over the
``[tokens, 2 x ffn]`` tensor); elsewhere anyspeed's. The device is forced with
``ANYSPEED_DEVICE`` in a process of its own: Megatron keeps its ``jit_fuser`` on for CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROUTE = """
import anyspeed.megatron_adaptor  # noqa: F401
import torch.nn.functional as F
from megatron.core.fusions import fused_bias_swiglu as f
from megatron.core.transformer.transformer_config import TransformerConfig
from anyspeed import adaptor
cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                        gated_linear_unit=True, activation_func=F.silu)
compiled = hasattr(f.swiglu, "_torchdynamo_orig_callable")
print(adaptor._STATE.device.type, cfg.bias_activation_fusion, f.bias_swiglu_impl.__module__,
      compiled)
"""

PARITY = """
import torch
from anyspeed.features.ops.swiglu import bias_swiglu
torch.manual_seed(0)
x = torch.randn(2, 16, 64, requires_grad=True)
g = torch.randn(2, 16, 32)
y1 = f.bias_swiglu_impl(x, None)
(gx1,) = torch.autograd.grad(y1, x, g)
y2 = bias_swiglu(x, None)
(gx2,) = torch.autograd.grad(y2, x, g)
print((y1 - y2).abs().max().item(), (gx1 - gx2).abs().max().item())
"""


def _probe(device: str, code: str, tmp_path) -> list[str]:  # noqa: ANN001
    env = dict(
        os.environ, ANYSPEED_DEVICE=device, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.parametrize(
    "device, impl, compiled",
    [
        ("cpu", "anyspeed.features.ops.swiglu", "False"),
        ("cuda", "megatron.core.fusions.fused_bias_swiglu", "True"),
    ],
)
def test_swiglu_route_by_device(device: str, impl: str, compiled: str, tmp_path) -> None:  # noqa: ANN001
    """The config field that routes the MLP to the fused entry is on either way; the entry is
    Megatron's compiled one on CUDA and anyspeed's on the CPU."""
    assert _probe(device, ROUTE, tmp_path) == [device, "True", impl, compiled]


@pytest.mark.slow
def test_megatrons_compiled_swiglu_equals_anyspeeds(tmp_path) -> None:  # noqa: ANN001
    """The CUDA route computes what the CPU route does: Megatron's compiled SwiGLU (run by
    Inductor on CPU tensors here) against anyspeed's, values and input gradients (fp32)."""
    out = _probe("cuda", ROUTE + PARITY, tmp_path)
    assert out[:4] == ["cuda", "True", "megatron.core.fusions.fused_bias_swiglu", "True"]
    values, grads = float(out[4]), float(out[5])
    assert values <= 1e-6 and grads <= 1e-5
