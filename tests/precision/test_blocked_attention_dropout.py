"""Blocked attention with dropout equals plain-torch math attention given the same dropout mask
(forward and backward, 1e-5 fp32) with causal, padding and document masks and GQA; it keeps
memory linear in the sequence for backward, and the mask is regenerated, not stored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from anyspeed.features.ops.blocked_attention import (
    block_drop,
    blocked_attention,
    dropout_path,
    full_keep,
)

B, HQ, S, D, BLOCK, P, SEED = 2, 4, 200, 16, 64, 0.2, 1234


def _masks(kind: str) -> tuple[bool, torch.Tensor | None]:
    """(causal flag, boolean keep-mask [b, 1, s, s] or None) of a mask kind."""
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    if kind == "causal":
        return True, None
    if kind == "padding":  # the second sample's last 50 keys are padding
        keep = causal.expand(B, 1, S, S).clone()
        keep[1, :, :, S - 50 :] = False
        return False, keep
    doc = torch.tensor([0] * 70 + [1] * 90 + [2] * 40)  # packed documents
    return False, (causal & (doc[:, None] == doc[None, :])).expand(B, 1, S, S)


def _math(q, k, v, keep, causal, scale, multiplier):
    """Plain softmax attention with an explicit dropout multiplier (the reference)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, -1) * multiplier) @ v


@pytest.mark.parametrize("kind", ["causal", "padding", "document"])
@pytest.mark.parametrize("hkv", [HQ, 2])
def test_equals_math_with_the_same_mask(kind, hkv):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, generator=gen) for h in (HQ, hkv, hkv))
    causal, keep = _masks(kind)
    multiplier = full_keep(B, HQ, S, S, P, SEED, BLOCK, causal)
    grad = torch.randn(B, HQ, S, D, generator=gen)
    outs = []
    for fn in (
        lambda q, k, v: blocked_attention(
            q, k, v, keep, causal=causal, dropout_p=P, seed=SEED, block=BLOCK
        ),  # fmt: skip
        lambda q, k, v: _math(q, k, v, keep, causal, D**-0.5, multiplier),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad)
        outs.append([out.detach()] + [t.grad for t in leaves])
    for got, ref in zip(*outs, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert outs[0][0].abs().max() > 0.1  # not all zero


def test_without_dropout_equals_sdpa():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, HQ, S, D, generator=gen) for _ in range(3))
    got = blocked_attention(q, k, v, causal=True, block=BLOCK)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=0, atol=1e-5)  # fmt: skip


def test_dropout_rate_and_regeneration():
    shape = (2, 8, 256, 256)
    cpu = torch.device("cpu")
    drop = block_drop(shape, 0.1, SEED, 5, cpu)
    assert abs(drop.float().mean().item() - 0.1) < 0.002
    assert torch.equal(drop, block_drop(shape, 0.1, SEED, 5, cpu))
    assert not torch.equal(drop, block_drop(shape, 0.1, SEED, 6, cpu))
    assert not torch.equal(drop, block_drop(shape, 0.1, SEED + 1, 5, cpu))


def _saved_bytes(fn, s: int) -> int:
    """Bytes of the unique storages autograd keeps for backward (inputs included)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    q, k, v = (torch.randn(1, 2, s, 16, requires_grad=True) for _ in range(3))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, k, v)
    return sum(storages.values())


def test_saved_bytes_linear_in_sequence():
    def blocked(q, k, v):
        return blocked_attention(q, k, v, causal=True, dropout_p=P, seed=SEED)

    def math(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=P)

    sizes = (512, 1024, 2048)
    got = [_saved_bytes(blocked, s) for s in sizes]
    assert got[1] == 2 * got[0] and got[2] == 2 * got[1]
    # q, k, v, output (4 x s x 2 heads x 16 x 4 bytes) and one fp32 log-sum-exp per query row
    assert got[2] == 4 * 2048 * 2 * 16 * 4 + 2048 * 2 * 4
    assert _saved_bytes(math, 2048) > 20 * got[2]  # the math path keeps s x s per head


def test_features_report_names_the_path():
    assert "blocked attention" in dropout_path("cpu")
    assert "fused" in dropout_path("cuda") and "blocked" not in dropout_path("cuda")


def test_bf16_inputs_close_to_fp32():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, HQ, S, D, generator=gen) for _ in range(3))
    ref = blocked_attention(q, k, v, causal=True, dropout_p=P, seed=SEED)
    got = blocked_attention(*(t.bfloat16() for t in (q, k, v)), causal=True, dropout_p=P, seed=SEED)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=0, atol=3e-2)
