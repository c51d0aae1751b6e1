"""The GRPO objective against an independent plain-PyTorch reference written token by token
(float64): loss and gradient for every aggregation, k3/k1/k2 KL and the entropy bonus, over
two optimizer passes on the same rollout (mu = 2, so the ratio is not 1 and the clip acts);
group advantages by hand; degenerate cases."""

from __future__ import annotations

import math

import pytest
import torch

from anyspeed.stages.common.rl import objective as L

TOL = 1e-6
B, T, MICRO, MAX_LEN = 6, 7, 2, 9  # sequences, positions, sequences per micro-batch


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, (a, n) in enumerate([(1, 5), (2, 4), (0, 7), (3, 2), (1, 1), (2, 5)]):
        mask[i, a : a + n] = 1
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    return {"mask": mask, "old": old,
            "ref": old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
            "ent": torch.rand(B, T, generator=g, dtype=torch.float64) * 2,
            "adv": torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, 0.0], dtype=torch.float64)}  # fmt: skip


def reference(logp, b, mode, lo, hi, beta, kind, c_ent) -> torch.Tensor:
    """The objective spelled out per token, as the papers write it."""
    per_seq, counts, micro = [], [], []
    for i in range(B):
        vals = []
        for t in range(T):
            if not b["mask"][i, t]:
                continue
            ratio = torch.exp(logp[i, t] - b["old"][i, t])
            a = b["adv"][i]
            pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - lo, 1 + hi))
            d = b["ref"][i, t] - logp[i, t]
            kl = {"low_var_kl": torch.exp(d) - d - 1, "kl": -d, "mse": 0.5 * d * d}[kind]
            vals.append(pg + beta * kl - c_ent * b["ent"][i, t])
        per_seq.append(torch.stack(vals).sum())
        counts.append(len(vals))
    if mode == "token-mean":
        return torch.stack(per_seq).sum() / sum(counts)
    if mode == "seq-mean-token-mean":
        return torch.stack([s / n for s, n in zip(per_seq, counts, strict=True)]).mean()
    if mode == "seq-mean-token-sum-norm":
        return torch.stack([s / MAX_LEN for s in per_seq]).mean()
    for m in range(0, B, MICRO):
        micro.append(torch.stack(per_seq[m : m + MICRO]).sum() / sum(counts[m : m + MICRO]))
    return torch.stack(micro).mean()


def ours(logp, b, mode, lo, hi, beta, kind, c_ent, level="token") -> torch.Tensor:
    """The task's path: micro-batches of (sum, count), summed and divided once."""
    sums, counts = [], []
    for m in range(0, B, MICRO):
        s = slice(m, m + MICRO)
        log_w = L.log_importance(logp[s], b["old"][s], b["mask"][s], level)
        t = L.policy_terms(log_w, b["adv"][s, None].expand(-1, T), lo, hi)
        v = t["pg"] + beta * L.kl_penalty(logp[s], b["ref"][s], kind) - c_ent * b["ent"][s]
        total, count = L.aggregate((v * b["mask"][s]).sum(-1), b["mask"][s].sum(-1), mode, MAX_LEN)
        sums.append(total)
        counts.append(count)
    return torch.stack(sums).sum() / torch.stack(counts).sum()


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
@pytest.mark.parametrize("kind", L.KL_PENALTIES)
def test_objective_and_gradient_over_two_passes(mode, kind):
    b = batch()
    args = (mode, 0.2, 0.28, 0.04, kind, 0.01)
    theta = b["old"].clone().requires_grad_(True)  # the policy's log-probs, before any update
    clipped = 0.0
    for _ in range(2):  # mu = 2: the second pass sees ratios away from 1
        want = reference(theta, b, *args)
        (g_want,) = torch.autograd.grad(want, theta)
        got = ours(theta, b, *args)
        (g_got,) = torch.autograd.grad(got, theta)
        assert float(got) == pytest.approx(float(want), abs=TOL)
        assert torch.allclose(g_got, g_want, atol=TOL, rtol=0)
        log_w = theta.detach() - b["old"]
        t = L.policy_terms(log_w, b["adv"][:, None].expand(-1, T), 0.2, 0.28)
        clipped = float((t["clipped"] * b["mask"]).sum())
        with torch.no_grad():
            theta -= 8.0 * g_want  # a large step: some ratios leave [0.8, 1.28]
    assert clipped > 0  # the second pass exercised the clip


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, 0.0, 1.0, 1.0])
    got = L.group_advantages(r, 4).tolist()
    for g in range(3):
        xs = r[4 * g : 4 * g + 4].tolist()
        mu = sum(xs) / 4
        sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / 3)  # unbiased
        assert got[4 * g : 4 * g + 4] == pytest.approx([(x - mu) / (sd + 1e-6) for x in xs])
    assert got[4:8] == [0.0] * 4  # equal rewards: no advantage
    dr = L.group_advantages(r, 4, "group_mean").tolist()
    assert dr[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_degenerate_cases():
    b = batch()
    adv = torch.zeros(B, T, dtype=torch.float64)
    theta = b["old"].clone().requires_grad_(True)
    t = L.policy_terms(L.log_importance(theta, b["old"], b["mask"]), adv, 0.2, 0.2)
    assert bool((t["ratio"] == 1).all()) and float(t["clipped"].sum()) == 0  # on-policy
    (g,) = torch.autograd.grad((t["pg"] * b["mask"]).sum(), theta)
    assert float(g.abs().max()) == 0  # equal rewards everywhere: no gradient
    assert float(L.kl_penalty(b["old"], b["old"], "low_var_kl").abs().max()) == 0


def gspo_reference(logp, b, lo, hi, level) -> torch.Tensor:
    """GSPO as its paper writes it (arXiv 2507.18071): s_i = (prod_t pi/pi_old)^(1/|o_i|), the
    loss -mean_i min(s_i A_i, clip(s_i) A_i); GSPO-token: s_i,t = sg(s_i) pi_t / sg(pi_t) in each
    token's clipped term, averaged over the sequence's tokens, then over sequences."""
    per_seq = []
    for i in range(B):
        idx = [t for t in range(T) if b["mask"][i, t]]
        ratios = torch.stack([torch.exp(logp[i, t] - b["old"][i, t]) for t in idx])
        s_i = torch.prod(ratios) ** (1.0 / len(idx))
        a = b["adv"][i]
        if level == "sequence":
            per_seq.append(torch.maximum(-a * s_i, -a * torch.clamp(s_i, 1 - lo, 1 + hi)))
            continue
        terms = []
        for t in idx:
            w = s_i.detach() * torch.exp(logp[i, t] - logp[i, t].detach())
            terms.append(torch.maximum(-a * w, -a * torch.clamp(w, 1 - lo, 1 + hi)))
        per_seq.append(torch.stack(terms).mean())
    return torch.stack(per_seq).mean()


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_gspo_against_its_paper_over_two_passes(level):
    """GSPO and GSPO-token within 1e-7 of the hand reference, loss and gradient, on the first
    pass (ratio 1) and a second one whose sequence ratios left the (narrow) clip range."""
    b = batch(1)
    theta = b["old"].clone().requires_grad_(True)
    lo, hi = 3e-4, 4e-4  # the paper's clip
    seen_clip = False
    for _ in range(2):
        want = gspo_reference(theta, b, lo, hi, level)
        (g_want,) = torch.autograd.grad(want, theta)
        got = ours(theta, b, "seq-mean-token-mean", lo, hi, 0.0, "kl", 0.0, level)
        (g_got,) = torch.autograd.grad(got, theta)
        assert float(got) == pytest.approx(float(want), abs=1e-7)
        assert torch.allclose(g_got, g_want, atol=1e-7, rtol=0)
        log_w = L.log_importance(theta.detach(), b["old"], b["mask"], level)
        t = L.policy_terms(log_w, b["adv"][:, None].expand(-1, T), lo, hi)
        seen_clip = seen_clip or float((t["clipped"] * b["mask"]).sum()) > 0
        with torch.no_grad():
            theta -= 2.0 * g_want
    assert seen_clip


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_gspo_on_policy_has_grpo_gradient(level):
    """At mu = 1 (the first mini-batch: every ratio 1) GSPO's gradient is GRPO's under
    seq-mean-token-mean, within 1e-7."""
    b = batch(2)
    theta = b["old"].clone().requires_grad_(True)
    (g_gspo,) = torch.autograd.grad(
        ours(theta, b, "seq-mean-token-mean", 0.2, 0.2, 0.0, "kl", 0.0, level), theta
    )
    (g_grpo,) = torch.autograd.grad(
        ours(theta, b, "seq-mean-token-mean", 0.2, 0.2, 0.0, "kl", 0.0), theta
    )
    assert float(g_grpo.abs().max()) > 0.01
    assert torch.allclose(g_gspo, g_grpo, atol=1e-7, rtol=0)
