"""Packed (``thd``) attention with dropout on a device whose fused kernels have none (the
CPU): each segment goes through the blocked kernel, as padded rows do, not the S x S math
kernel; a segment's output does not depend on another segment's tokens; without dropout it is
SDPA's. With sinks, a window and soft-capped scores (GPT-OSS, Gemma) each segment is the
plain-PyTorch formula of its own tokens (the window from the segment's start)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from anyspeed.features.ops import attention as A

BOUNDS = [0, 5, 12, 16]  # three packed sequences


def _stub(p: float, sink=None, window=None, cap=None) -> SimpleNamespace:
    # sequence_parallel: the dropout runs without the model-parallel RNG tracker's fork
    return SimpleNamespace(attention_dropout=torch.nn.Dropout(p), training=True, softmax_scale=None,
                           config=SimpleNamespace(sequence_parallel=True),
                           hidden_size_per_partition=4 * 8, softmax_offset=sink,
                           scale_mask_softmax=SimpleNamespace(window_size=window),
                           logit_softcap=cap)  # fmt: skip


def _qkv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, h, 8, generator=g) for h in (4, 2, 2)]  # GQA: 4 queries, 2 kv heads


def _run(p: float, qkv: list[torch.Tensor], monkeypatch, calls: list) -> torch.Tensor:
    blocked = A.blocked_attention

    def counted(*args, **kwargs):
        calls.append(kwargs["dropout_p"])
        return blocked(*args, **kwargs)

    monkeypatch.setattr(A, "blocked_attention", counted)
    params = SimpleNamespace(cu_seqlens_q=torch.tensor(BOUNDS), cu_seqlens_q_padded=None)
    torch.manual_seed(0)  # the dropout seeds each call draws
    return A.SDPAttention._packed(_stub(p), *qkv, params)


def test_dropout_goes_through_the_blocked_kernel_per_segment(monkeypatch):
    calls: list = []
    qkv = _qkv(1)
    out = _run(0.3, qkv, monkeypatch, calls)
    assert calls == [0.3] * 3 and out.shape == (16, 32)
    other = [x.clone() for x in qkv]
    for x in other:  # the first sequence's tokens changed: the others' outputs are not
        x[:5] = torch.randn(5, *x.shape[1:])
    again = _run(0.3, other, monkeypatch, [])
    assert torch.equal(again[5:], out[5:]) and not torch.equal(again[:5], out[:5])


def test_without_dropout_each_segment_is_sdpa(monkeypatch):
    calls: list = []
    qkv = _qkv(2)
    out = _run(0.0, qkv, monkeypatch, calls)
    assert calls == []
    for lo, hi in zip(BOUNDS[:-1], BOUNDS[1:], strict=True):
        q, k, v = (x[lo:hi].transpose(0, 1) for x in qkv)
        k, v = (x.repeat_interleave(2, dim=0) for x in (k, v))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[lo:hi], want.reshape(hi - lo, 32), rtol=0, atol=1e-6)


def test_sinks_windows_and_caps_run_per_segment(monkeypatch):
    from test_attention_sinks import reference

    qkv = _qkv(3)
    sink = torch.randn(4, generator=torch.Generator().manual_seed(4))
    params = SimpleNamespace(cu_seqlens_q=torch.tensor(BOUNDS), cu_seqlens_q_padded=None)
    stub = _stub(0.0, sink=sink, window=(2, 0), cap=1.5)
    out = A.SDPAttention._packed(stub, *qkv, params)
    for lo, hi in zip(BOUNDS[:-1], BOUNDS[1:], strict=True):
        q, k, v = (x[lo:hi].transpose(0, 1).unsqueeze(0).double() for x in qkv)
        want = reference(q, k, v, sink.double(), 2, 1.5)[0].transpose(0, 1)
        torch.testing.assert_close(out[lo:hi].double(), want.reshape(hi - lo, 32), rtol=0,
                                   atol=1e-6)  # fmt: skip
