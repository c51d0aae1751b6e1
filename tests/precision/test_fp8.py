"""FP8 GEMMs without Transformer Engine (``--fp8-format``): the casts round to the nearest FP8
value (against a table of every FP8 number), the linear layer's forward and both gradients equal
plain fake-quantized PyTorch math, delayed scaling follows Transformer Engine's rule, and the
model-level runs are checked in ``test_fp8_layouts.py``."""

from __future__ import annotations

import pytest
import torch

from anyspeed.features.fp8.linear import Fp8Linear
from anyspeed.features.fp8.numerics import E4M3, E5M2, Scales, quantize, scale_for
from anyspeed.features.fp8.settings import Fp8Settings

TOP = {E4M3: 448.0, E5M2: 57344.0}


def _table(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite value of ``dtype`` and whether its mantissa is even (its bit 0 is 0)."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).float()
    keep = torch.isfinite(values)
    return values[keep], (codes[keep] & 1) == 0


def _nearest(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to the nearest representable value (saturating), by search in the table; a tie
    goes to the even mantissa (IEEE round-half-to-even)."""
    table, even = _table(dtype)
    x = x.clamp(-TOP[dtype], TOP[dtype])
    dist = (x[..., None] - table).abs()
    nearest = dist == dist.min(-1, keepdim=True).values
    pick = torch.where((nearest & even).any(-1, keepdim=True), nearest & even, nearest)
    return table[pick.int().argmax(-1)]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_rounds_to_the_nearest_fp8_value_and_saturates(dtype):
    torch.manual_seed(0)
    x = torch.randn(4000) * 3
    x[:3] = torch.tensor([1e6, -1e6, 0.0])
    x[3:] = x[3:].bfloat16().float()  # bf16 inputs: exact ties between FP8 values occur
    scale = scale_for(x.abs().amax() / 10, dtype, margin=0)  # the top 10x saturates
    got = quantize(x, dtype, scale).float()
    want = _nearest(x * scale, dtype)
    assert torch.equal(got, want)
    assert got.abs().max() == TOP[dtype]


def test_ties_round_to_the_even_mantissa():
    one = torch.tensor(1.0)
    ties = torch.tensor([1.0625, 1.1875, -1.0625, 36864.0])  # halfway between two values
    assert quantize(ties[:3], E4M3, one).float().tolist() == [1.0, 1.25, -1.0]
    assert quantize(ties[3:], E5M2, one).float().tolist() == [32768.0]
    assert torch.equal(_nearest(ties[:3], E4M3), torch.tensor([1.0, 1.25, -1.0]))


def test_scale_rule():
    amax = torch.tensor([2.0, 0.0, float("inf")])
    prev = torch.tensor([5.0, 6.0, 7.0])
    got = scale_for(amax, E4M3, margin=1, previous=prev)
    assert torch.equal(got, torch.tensor([448.0 / 2 / 2, 6.0, 7.0]))
    assert torch.equal(scale_for(torch.tensor(0.0), E5M2, 0), torch.tensor(1.0))


def _fake(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fake-quantized ``x`` (its dequantized FP8 value) with a scale from its own amax."""
    scale = TOP[dtype] / x.abs().max()
    return _nearest(x * scale, dtype) / scale


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("wgrad", [True, False])
def test_linear_equals_fake_quantized_math(fmt, wgrad):
    torch.manual_seed(1)
    x = torch.randn(6, 3, 32, requires_grad=True)
    w = (torch.randn(48, 32) * 0.05).requires_grad_()
    b = torch.randn(48, requires_grad=True)
    dy = torch.randn(6, 3, 48) * 1e-3
    settings = Fp8Settings(format=fmt, recipe="tensorwise", wgrad=wgrad)
    y = Fp8Linear.apply(x, w, b, Scales(settings), None, False, False)
    y.backward(dy)

    grad_t = E5M2 if fmt == "hybrid" else E4M3
    xq, wq, gq = _fake(x.detach(), E4M3), _fake(w.detach(), E4M3), _fake(dy, grad_t)
    torch.testing.assert_close(y, xq @ wq.t() + b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, gq @ wq, rtol=1e-6, atol=1e-9)
    x_used = xq if wgrad else x.detach()
    g_used = gq if wgrad else dy
    want_dw = g_used.reshape(-1, 48).t() @ x_used.reshape(-1, 32)
    torch.testing.assert_close(w.grad, want_dw, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(b.grad, dy.sum((0, 1)))
    # and it is not the unquantized layer
    assert (y - (x @ w.t() + b)).abs().max() > 1e-4


def test_frozen_weight_and_no_bias():
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(8, 16)
    scales = Scales(Fp8Settings(recipe="tensorwise"))
    y = Fp8Linear.apply(x, w, None, scales, None, False, False)
    y.sum().backward()
    assert w.grad is None and x.grad is not None and y.shape == (4, 8)


def test_delayed_scaling_uses_the_amax_history():
    """Transformer Engine's delayed rule: each call quantizes with the scale its earlier calls'
    amaxes give (``max`` over a history of 2 here); the first call has its own amax."""
    settings = Fp8Settings(recipe="delayed", amax_history_len=2, amax_compute_algo="max")
    scales = Scales(settings)
    mags = [1.0, 4.0, 2.0, 0.5]
    used = []
    for m in mags:
        x = torch.full((8,), m)
        x[0] = -m
        used.append(float(scales("input", x, None)))
    want = [448 / 1.0, 448 / 1.0, 448 / 4.0, 448 / 4.0]  # history max of [now-1, now-2]
    assert used == pytest.approx(want)
    with torch.no_grad():  # an evaluation pass reads the scale and leaves the history
        scales("input", torch.full((8,), 100.0), None)
    assert float(scales("input", torch.ones(8), None)) == pytest.approx(448 / 2.0)


def test_bf16_linear_rounds_only_its_output():
    """In bf16 the emulated GEMMs multiply the FP8 values exactly and round the product: the
    result is the fp32 fake-quantized math within bf16's rounding (two roundings, 2**-7)."""
    torch.manual_seed(2)
    x = torch.randn(64, 32).bfloat16().requires_grad_()
    w = (torch.randn(48, 32) * 0.05).bfloat16().requires_grad_()
    dy = (torch.randn(64, 48) * 1e-3).bfloat16()
    y = Fp8Linear.apply(x, w, None, Scales(Fp8Settings(recipe="tensorwise")), None, False, False)
    y.backward(dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    xq, wq = _fake(x.detach().float(), E4M3), _fake(w.detach().float(), E4M3)
    gq = _fake(dy.float(), E5M2)
    for got, want in ((y, xq @ wq.t()), (x.grad, gq @ wq), (w.grad, gq.t() @ xq)):
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=want.abs().max() * 2**-8)
