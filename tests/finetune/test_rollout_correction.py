"""Rollout correction (``stages/common/rl/correction.py``) against a hand reference written per
token from verl's definitions (float64): the loss and gradient of every weighting and masking
mode over two passes of one rollout (ratios away from 1, caps and rejections active), the
diagnostics, and the identity: with the rollout's log-probs equal to the old ones, correction on
is correction off bit for bit."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from anyspeed.stages.common.rl import correction as C
from anyspeed.stages.common.rl import objective as L

B, T, MICRO = 6, 7, 2
LO, HI = 0.2, 0.28


def rollout(seed: int = 0, noise: float = 0.4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, (a, n) in enumerate([(1, 5), (2, 4), (0, 7), (3, 2), (1, 1), (2, 5)]):
        mask[i, a : a + n] = 1
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    roll = old + noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.3], dtype=torch.float64)
    return {"mask": mask, "old": old, "roll": roll, "adv": adv}


def reference(theta, d, c: C.Correction) -> torch.Tensor:
    """Token-mean loss: Σ over kept tokens of w·max(−A·r, −A·clip(r)) / (kept tokens)."""
    total, count = 0.0, 0
    for i in range(B):
        idx = [t for t in range(T) if d["mask"][i, t]]
        rho = [math.exp(float(d["old"][i, t] - d["roll"][i, t])) for t in idx]
        prod = math.prod(rho)
        for k, t in enumerate(idx):
            stat = {"token": rho[k], "sequence": prod, "geometric": prod ** (1 / len(idx))}
            if c.rs_level and not c.rs_lower <= stat[c.rs_level] <= c.rs_upper:
                continue
            w = {"token": min(rho[k], c.is_threshold), "sequence": min(prod, c.is_threshold),
                 None: 1.0}[c.is_level]  # fmt: skip
            r = torch.exp(theta[i, t] - d["old"][i, t])
            a = d["adv"][i]
            total = total + w * torch.maximum(-a * r, -a * torch.clamp(r, 1 - LO, 1 + HI))
            count += 1
    return total / count


def ours(theta, d, c: C.Correction | None) -> torch.Tensor:
    """The task's path: per micro-batch, the correction applied at rollout time, then the
    weighted policy term over the kept tokens, (sum, count) divided once."""
    sums, counts = [], []
    for m in range(0, B, MICRO):
        s = slice(m, m + MICRO)
        b = {
            "loss_mask": d["mask"][s].clone(),
            "old_logp": d["old"][s],
            "rollout_logp": d["roll"][s],
        }
        if c is not None:
            C.apply(b, c)
        log_w = L.log_importance(theta[s], d["old"][s], b["loss_mask"])
        pg = L.policy_terms(log_w, d["adv"][s, None].expand(-1, T), LO, HI)["pg"]
        pg = pg * b["is_weight"] if "is_weight" in b else pg
        total, count = L.aggregate((pg * b["loss_mask"]).sum(-1), b["loss_mask"].sum(-1),
                                   "token-mean", 9)  # fmt: skip
        sums.append(total)
        counts.append(count)
    return torch.stack(sums).sum() / torch.stack(counts).sum()


MODES = [
    C.Correction("token", 1.2, None, 2.0, 0.5),
    C.Correction("sequence", 1.5, None, 2.0, 0.5),
    C.Correction(None, 2.0, "token", 1.5, 0.7),
    C.Correction(None, 2.0, "sequence", 1.5, 0.6),
    C.Correction(None, 2.0, "geometric", 1.2, 0.85),
    C.Correction("token", 1.3, "sequence", 1.6, 1 / 1.6),
]


@pytest.mark.parametrize("c", MODES, ids=lambda c: f"is-{c.is_level}-rs-{c.rs_level}")
def test_every_mode_against_the_hand_reference_over_two_passes(c):
    d = rollout()
    theta = d["old"].clone().requires_grad_(True)
    for _ in range(2):  # the second pass: ratios to the old policy away from 1 too
        want = reference(theta, d, c)
        (g_want,) = torch.autograd.grad(want, theta)
        got = ours(theta, d, c)
        (g_got,) = torch.autograd.grad(got, theta)
        assert float(got.detach()) == pytest.approx(float(want.detach()), abs=1e-7)
        assert torch.allclose(g_got, g_want, atol=1e-7, rtol=0)
        with torch.no_grad():
            theta -= 4.0 * g_want
    # the caps and rejections acted (the test would not see them otherwise)
    b = {"loss_mask": d["mask"].clone(), "old_logp": d["old"], "rollout_logp": d["roll"]}
    C.apply(b, c)
    if c.is_level:
        assert float(((b["is_weight"] == c.is_threshold) * d["mask"]).sum()) > 0
    if c.rs_level:
        assert 0 < float(b["loss_mask"].sum()) < float(d["mask"].sum())


def test_without_a_gap_correction_on_is_off_bit_for_bit():
    d = rollout(1)
    d["roll"] = d["old"].clone()  # fp32 at the training layout: the same log-probs
    theta = (d["old"] + 0.05).requires_grad_(True)
    off = ours(theta, d, None)
    (g_off,) = torch.autograd.grad(off, theta)
    for c in MODES:
        on = ours(theta, d, c)
        (g_on,) = torch.autograd.grad(on, theta)
        assert torch.equal(on, off) and torch.equal(g_on, g_off)


def test_diagnostics_by_hand():
    d = rollout(2)
    c = MODES[0]
    b = {"loss_mask": d["mask"].clone(), "old_logp": d["old"], "rollout_logp": d["roll"]}
    C.apply(b, c)
    got = {k: float(v[0] / v[1]) for k, v in C.diagnostics(b, c).items()}
    ell = [(float(d["old"][i, t] - d["roll"][i, t])) for i in range(B) for t in range(T)
           if d["mask"][i, t]]  # fmt: skip
    n = len(ell)
    assert got["rollout_corr/kl"] == pytest.approx(sum(-x for x in ell) / n)
    assert got["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in ell) / n)
    assert got["rollout_corr/chi2_token"] == pytest.approx(
        sum(math.exp(2 * x) - 1 for x in ell) / n
    )
    sums = [float(((d["old"][i] - d["roll"][i]) * d["mask"][i]).sum()) for i in range(B)]
    assert got["rollout_corr/chi2_seq"] == pytest.approx(sum(math.exp(2 * s) - 1 for s in sums) / B)
    assert got["rollout_corr/rollout_is_mean"] == pytest.approx(sum(math.exp(x) for x in ell) / n)
    assert got["rollout_corr/rollout_rs_masked_fraction"] == 0.0


def _args(**kw) -> argparse.Namespace:
    base = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_rs": None,
            "rollout_rs_threshold": None, "rollout_rs_threshold_lower": None}  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_flags():
    assert C.from_args(_args()) is None
    got = C.from_args(_args(rollout_rs="geometric", rollout_rs_threshold=1.001))
    assert got == C.Correction(None, 2.0, "geometric", 1.001, 1 / 1.001)
    assert C.from_args(_args(rollout_is="token")).rs_upper == 2.0
    with pytest.raises(C.UsageError, match="--rollout-rs-threshold without --rollout-rs"):
        C.from_args(_args(rollout_rs_threshold=3.0))
    with pytest.raises(C.UsageError, match="must be below --rollout-rs-threshold 2"):
        C.from_args(_args(rollout_rs="token", rollout_rs_threshold_lower=2.5))
