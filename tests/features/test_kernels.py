"""Level-1 kernels vs. Megatron's original modules, forward and backward.

Tolerances: fp32 1e-5 max-abs; bf16 inputs 3e-2 max-abs, or 1% of the largest magnitude for
attention (bf16 has 8 mantissa bits and the two sides round at different points).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from anyspeed.features.ops.rope import apply_rope
from anyspeed.features.ops.swiglu import bias_swiglu
from anyspeed.testing import run_distributed
from helpers import feature_ranks, trainer_ranks


@pytest.fixture
def device_layer():
    """Megatron's RotaryEmbedding allocates on torch.cuda.current_device(): route it here."""
    from anyspeed import adaptor

    adaptor.apply(argv=["--optimization-level", "0"])
    yield
    adaptor.undo()


TOL = {"fp32": 1e-5, "bf16": 3e-2}
DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def attention_results():
    # Level 0 in the rank: Megatron's DotProductAttention is the unpatched reference.
    return run_distributed(
        feature_ranks.attention_parity_all, 1, timeout=180, argv=["--optimization-level", "0"]
    )[0]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize(
    "mask_kind", ["causal", "padding", "document", "sink", "window", "sink-window"]
)
def test_attention_matches_megatron(attention_results, dtype, gqa, mask_kind):
    """SDPAttention (sinks and windows: blocked attention) against Megatron's own class; the
    gradient of the sinks is compared too."""
    res = attention_results[(dtype, gqa, mask_kind)]
    if dtype == "fp32":
        assert res["out"] <= TOL[dtype] and res["grad"] <= TOL[dtype], res
    else:  # bf16: within 1% of the largest magnitude (a few bf16 ulps)
        assert res["out_rel"] <= 1e-2 and res["grad_rel"] <= 1e-2, res


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_swiglu_matches_unfused(dtype):
    dt = DT[dtype]
    x = torch.randn(6, 5, 2 * 24, generator=torch.Generator().manual_seed(0)).to(dt)
    g = torch.randn(6, 5, 24, generator=torch.Generator().manual_seed(1)).to(dt)
    a = x.clone().requires_grad_()
    a1, a2 = a.chunk(2, dim=-1)
    ref = F.silu(a1) * a2  # Megatron's unfused glu
    ref.backward(g)
    b = x.clone().requires_grad_()
    out = bias_swiglu(b, None)
    out.backward(g)
    assert (ref.float() - out.float()).abs().max() <= TOL[dtype]
    assert (a.grad.float() - b.grad.float()).abs().max() <= TOL[dtype] * 4
    with torch.no_grad():
        assert (ref.detach().float() - bias_swiglu(x, None).float()).abs().max() <= TOL[dtype]


def test_cpu_rmsnorm_matches_torch_rms_norm():
    """``fused-norm``'s RMSNorm under inference mode equals ``F.rms_norm`` (fp32, 1e-5); with
    grad, or under plain no-grad (recomputation's first pass), it is ``F.rms_norm`` itself,
    bit for bit, and so is bf16."""
    from anyspeed.features.ops import norm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, 40, generator=gen).mul_(3)
    w = torch.randn(40, generator=gen)
    ref = F.rms_norm(x, (40,), w, 1e-6)
    with torch.inference_mode():
        got = norm.fused_rms_norm(x, (40,), w, 1e-6)
        assert not torch.equal(got, ref)  # its own passes ran
        bf16 = norm.fused_rms_norm(x.bfloat16(), (40,), w.bfloat16(), 1e-6)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert torch.equal(bf16, F.rms_norm(x.bfloat16(), (40,), w.bfloat16(), 1e-6))
    with torch.no_grad():
        assert torch.equal(norm.fused_rms_norm(x, (40,), w, 1e-6), ref)
    xg = x.clone().requires_grad_()
    assert torch.equal(norm.fused_rms_norm(xg, (40,), w, 1e-6), ref)


def test_fused_norm_is_what_level_1_norms_run():
    """Level 1 routes the norm module's RMSNorm to the CPU kernel; level 0 keeps torch's."""
    from anyspeed import adaptor
    from anyspeed.features.ops import norm

    plain = norm.rms_norm
    assert plain is not norm.fused_rms_norm
    for level, expected in (("0", plain), ("1", norm.fused_rms_norm)):
        adaptor.apply(argv=["--optimization-level", level])
        try:
            assert norm.rms_norm is expected, level
        finally:
            adaptor.undo()
    assert norm.rms_norm is plain


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
@pytest.mark.parametrize("scaling", [False, True])
def test_rope_matches_megatron(dtype, interleaved, rotary_percent, scaling, device_layer):
    d, s = 32, 20
    emb = RotaryEmbedding(
        d,
        rotary_percent=rotary_percent,
        rope_scaling=scaling,
        rope_scaling_factor=8.0,
        rotary_base=500000,
        use_cpu_initialization=True,
    )
    freqs = emb(s)  # [s, 1, 1, rot], LLaMA-3 scaling folded in when requested
    dt = DT[dtype]
    t = torch.randn(s, 2, 4, d, generator=torch.Generator().manual_seed(0)).to(dt)
    g = torch.randn(s, 2, 4, d, generator=torch.Generator().manual_seed(1)).to(dt)
    a = t.clone().requires_grad_()
    ref = _apply_rotary_pos_emb_bshd(a, freqs, rotary_interleaved=interleaved)
    ref.backward(g)
    b = t.clone().requires_grad_()
    out = apply_rope(b, freqs, interleaved)
    out.backward(g)
    assert (ref.float() - out.float()).abs().max() <= TOL[dtype]
    assert (a.grad.float() - b.grad.float()).abs().max() <= TOL[dtype]
    with torch.no_grad():  # decoding's path: tables cached per rotary table, sliced per step
        whole = apply_rope(t, freqs, interleaved)
        part = apply_rope(t[3:7], freqs[3:7], interleaved)
    assert (ref.detach().float() - whole.float()).abs().max() <= TOL[dtype]
    assert (ref.detach()[3:7].float() - part.float()).abs().max() <= TOL[dtype]


@pytest.mark.parametrize(
    "world,dtype",
    # CI runs one world size per dtype (the suite's time budget); -m slow runs the other two.
    [(1, "fp32"), (2, "bf16"), pytest.param(2, "fp32", marks=pytest.mark.slow),
     pytest.param(1, "bf16", marks=pytest.mark.slow)],
)  # fmt: skip
def test_cross_entropy_matches_megatron(world, dtype):
    res = run_distributed(
        feature_ranks.cross_entropy_parity,
        world,
        dtype=dtype,
        timeout=120,
        argv=["--optimization-level", "0"],
    )
    for r in res:
        # fp32 round-off in the log-sum-exp grows with the loss: logits x4 give per-token
        # losses up to 27, where a reordered 96-term sum moves the loss by a few 1e-5 (seen
        # once in a clean-clone run) and the gradients with it.
        tol = TOL[dtype] * (max(1.0, r["scale"] / 4) if dtype == "fp32" else 1.0)
        assert r["loss"] <= tol * 2 and r["grad"] <= tol, r


def test_level1_training_equals_level0(tmp_path):
    """3 steps of the tiny GPT: level 0 (Megatron's kernels) vs level 1 (anyspeed's)."""
    ((l0, core0), (l1, core1)) = run_distributed(
        trainer_ranks.level_runs, 1, ckpt=str(tmp_path / "init"), timeout=300
    )[0]
    for a, b in zip(l0, l1, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert [core0, core1] == ["DotProductAttention", "SDPAttention"]


def test_bf16_training_on_cpu_keeps_fp32_master_weights(tmp_path):
    """--bf16 on the CPU: bf16 model, fp32 master weights, loss falls and tracks fp32."""
    (runs,) = run_distributed(trainer_ranks.precision_runs, 1, ckpt=str(tmp_path / "init"),
                              steps=12, timeout=300)  # fmt: skip
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert bf16["model"] == ["torch.bfloat16"] and bf16["main"] == ["torch.float32"]
    assert fp32["model"] == ["torch.float32"]
    assert all(math.isfinite(x) for x in bf16["losses"])
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.1
    for a, b in zip(fp32["losses"], bf16["losses"], strict=True):
        assert b == pytest.approx(a, rel=2e-2)
