"""Attention sinks and sliding windows (GPT-OSS) and soft-capped scores (Gemma 2) in anyspeed's
blocked attention against the plain-PyTorch formula (in float64): scores, ``cap * tanh(s /
cap)``, the causal window mask, the sink logit as one more column of the softmax, the column
dropped, times V. Forward and every gradient (q, k, v, the
sinks) of the fp32 kernel within 1e-6 of the largest value (fp32 rounding: about 3e-7)."""

from __future__ import annotations

import math

import pytest
import torch

from anyspeed.features.ops.blocked_attention import blocked_attention


def reference(q, k, v, sink, window, cap=None):
    """softmax([q k^T * scale (masked), sink]) without the sink column, @ v (GQA repeated)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    i = torch.arange(q.shape[2]).unsqueeze(1)
    j = torch.arange(k.shape[2])
    masked = j > i
    if window is not None:
        masked |= i - j > window
    s = s.masked_fill(masked, float("-inf"))
    if sink is not None:
        col = sink.view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        s = torch.cat([s, col], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sink is not None:
        p = p[..., :-1]
    return p @ v


CASES = {  # sink, window, block, soft-cap
    "sink": (True, None, 64, None),
    "window": (False, 5, 8, None),
    "sink-window": (True, 5, 8, None),
    "sink-window-wide": (True, 30, 16, None),
    "sink-one-block": (True, 7, 64, None),
    "cap": (False, None, 8, 1.5),  # a small cap: most scores near it, where the slope is small
    "cap-window": (False, 5, 16, 1.5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_blocked_attention_with_sinks_and_windows_equals_the_formula(case):
    with_sink, window, block, cap = CASES[case]
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, s, d = 2, 4, 2, 40, 8

    def leaf(*shape):
        return torch.randn(*shape, generator=g).requires_grad_(True)

    q, k, v = leaf(b, hq, s, d), leaf(b, hkv, s, d), leaf(b, hkv, s, d)
    sink = leaf(hq) if with_sink else None
    grad = torch.randn(b, hq, s, d, generator=g)
    got = blocked_attention(q, k, v, causal=True, block=block, sink=sink, window=window, cap=cap)
    got_grads = torch.autograd.grad(got, [t for t in (q, k, v, sink) if t is not None], grad)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, sink) if t is not None]
    want = reference(*leaves[:3], leaves[3] if with_sink else None, window, cap)
    want_grads = torch.autograd.grad(want, leaves, grad.double())
    for name, a, w in zip(["out", "dq", "dk", "dv", "dsink"], (got, *got_grads),
                          (want, *want_grads), strict=False):  # fmt: skip
        err = (a.double() - w).abs().max().item()
        assert err <= 1e-6 * max(1.0, w.abs().max().item()), f"{name}: {err:.2e}"


def test_a_sink_lowers_every_row_weight_and_a_window_forgets_far_keys():
    """Independent of the formula: with a huge sink the output goes to 0; with window 0 each
    row sees only itself, so the output is V's own row."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 12, 4) for _ in range(3))
    out = blocked_attention(q, k, v, causal=True, sink=torch.full((2,), 60.0))
    assert out.abs().max() < 1e-12
    out = blocked_attention(q, k, v, causal=True, window=0)
    torch.testing.assert_close(out, v, rtol=0, atol=1e-6)


def test_a_window_needs_causal_attention():
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="sliding window is causal"):
        blocked_attention(q, q, q, causal=False, window=2)
