"""The gated delta rule (Qwen3-Next's gated DeltaNet) in plain PyTorch: the chunked form equals
the token-by-token form within 1e-5, forward and every gradient (inputs and initial state), and
both equal transformers' own torch fallbacks (``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``), with and without the query/key L2 norm, an initial
state, and a length that is not a multiple of the chunk."""

from __future__ import annotations

import pytest
import torch

from anyspeed.features.ops.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule

ATOL = 1e-5


def _inputs(b=2, t=45, h=3, dk=8, dv=6, seed=0, state=True):
    g = torch.Generator().manual_seed(seed)
    # keys of norm about 0.8: the rule is stable (with the L2 norm every key has norm 1)
    q, k = (torch.randn(b, t, h, dk, generator=g) * 0.8 / dk**0.5 for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g)
    decay = -torch.rand(b, t, h, generator=g) * 0.5  # log decay <= 0
    beta = torch.rand(b, t, h, generator=g)
    s0 = 0.3 * torch.randn(b, h, dk, dv, generator=g) if state else None
    return [x.requires_grad_() if x is not None else None for x in (q, k, v, decay, beta, s0)]


def _run(fn, inputs, **kw):
    q, k, v, g, beta, s0 = inputs
    o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, **kw)
    loss = (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() + (s.square()).sum()
    grads = torch.autograd.grad(loss, [x for x in inputs if x is not None])
    return o.detach(), s.detach(), grads


@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_equals_recurrent_forward_and_backward(l2norm, chunk):
    inputs = _inputs()
    o1, s1, g1 = _run(recurrent_gated_delta_rule, inputs, use_qk_l2norm=l2norm)
    o2, s2, g2 = _run(chunk_gated_delta_rule, inputs, use_qk_l2norm=l2norm, chunk_size=chunk)
    assert o1.abs().max() > 0.1 and len(g1) == 6
    torch.testing.assert_close(o2, o1, atol=ATOL, rtol=0)
    torch.testing.assert_close(s2, s1, atol=ATOL, rtol=0)
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL * max(1.0, float(b.abs().max())), rtol=0)


@pytest.mark.parametrize("l2norm", [False, True])
def test_both_forms_equal_transformers_torch_fallbacks(l2norm):
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    inputs = _inputs(seed=1)
    q, k, v, g, beta, s0 = (x.detach() for x in inputs)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    ref_chunk = mod.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, **kw)
    ref_rec = mod.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    mine = dict(initial_state=s0, output_final_state=True, use_qk_l2norm=l2norm)
    got_chunk = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, **mine)
    got_rec = recurrent_gated_delta_rule(q, k, v, g, beta, **mine)
    for got in (got_chunk, got_rec):
        for ref in (ref_chunk, ref_rec):
            torch.testing.assert_close(got[0], ref[0], atol=ATOL, rtol=0)
            torch.testing.assert_close(got[1], ref[1], atol=ATOL, rtol=0)


def test_without_initial_state_and_in_bf16():
    """No initial state is a zero state; bf16 inputs compute in fp32 and return bf16."""
    q, k, v, g, beta, _ = (x.detach() if x is not None else None for x in _inputs(state=False))
    zero = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    a, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)
    b, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, initial_state=zero)
    assert torch.equal(a, b)
    low, _ = chunk_gated_delta_rule(*(x.bfloat16() for x in (q, k, v, g, beta)), chunk_size=16)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), a, atol=0.1, rtol=0.05)
