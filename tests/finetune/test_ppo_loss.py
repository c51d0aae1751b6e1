"""PPO's objective (``stages/ppo/loss.py``) against plain references written from the formulas,
position by position (float64), on random tensors whose answer masks have holes (tool output
inside an answer): token rewards, GAE and returns, whitening, the dual-clip policy term, the
clipped value loss and the explained variance; the special case γ = λ = 1, V = 0."""

from __future__ import annotations

import math

import pytest
import torch

from anyspeed.stages.common.rl import objective as L
from anyspeed.stages.ppo import loss as P

B, S, TOL = 5, 12, 1e-6


def rollout(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, S, dtype=torch.float64)
    spans = [[(2, 9)], [(1, 4), (6, 10)], [(3, 12)], [(0, 2), (4, 5), (8, 11)], [(5, 7)]]
    for i, parts in enumerate(spans):  # rows 1 and 3: answers with masked holes
        for a, e in parts:
            mask[i, a:e] = 1
    return {
        "mask": mask,
        "values": torch.randn(B, S, generator=g, dtype=torch.float64),
        "rewards": torch.randn(B, S, generator=g, dtype=torch.float64) * mask,
        "score": torch.randn(B, generator=g, dtype=torch.float64),
        "kl": torch.rand(B, S, generator=g, dtype=torch.float64),
    }


def answer_positions(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def gae_reference(r, v, mask, gamma, lam):
    """Over each sequence's answer tokens only, right to left: the next answer token's value
    and advantage (0 past the last)."""
    adv = torch.zeros_like(v)
    for i in range(v.shape[0]):
        pos = answer_positions(mask, i)
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(pos):
            delta = r[i, t] + gamma * nxt_v - v[i, t]
            adv[i, t] = delta + gamma * lam * nxt_a
            nxt_v, nxt_a = v[i, t], adv[i, t]
    return adv, adv + v


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_and_returns_with_holes_in_the_answer(gamma, lam):
    d = rollout()
    adv, ret = P.gae(d["rewards"], d["values"], d["mask"], gamma, lam)
    want_a, want_r = gae_reference(d["rewards"], d["values"], d["mask"], gamma, lam)
    m = d["mask"] > 0
    assert torch.allclose(adv[m], want_a[m], atol=TOL, rtol=0)
    assert torch.allclose(ret[m], want_r[m], atol=TOL, rtol=0)


def test_holes_are_skipped_not_read():
    """MindSpeed-RL's form reads the next position's value even when it is masked; verl's
    (followed here) reads the next answer token's: they differ exactly on rows with holes."""
    d = rollout(1)
    adv, _ = P.gae(d["rewards"], d["values"], d["mask"], 1.0, 0.95)
    naive = torch.zeros_like(adv)
    nxt = torch.zeros(B, dtype=torch.float64)
    for t in reversed(range(S)):
        v_next = d["values"][:, t + 1] if t + 1 < S else torch.zeros(B, dtype=torch.float64)
        delta = d["rewards"][:, t] + v_next - d["values"][:, t]
        nxt = delta + 0.95 * nxt
        naive[:, t] = nxt
    m = d["mask"] > 0
    differs = [(adv[i][m[i]] - naive[i][m[i]]).abs().max() > 1e-3 for i in range(B)]
    assert differs[1] and differs[3]


def test_gamma_lambda_one_without_values_gives_whitened_returns():
    d = rollout(2)
    zero = torch.zeros(B, S, dtype=torch.float64)
    adv, ret = P.gae(d["rewards"], zero, d["mask"], 1.0, 1.0)
    m = d["mask"] > 0
    for i in range(B):  # reward to go over the answer tokens
        pos = answer_positions(d["mask"], i)
        for k, t in enumerate(pos):
            assert float(ret[i, t]) == pytest.approx(float(d["rewards"][i, pos[k:]].sum()))
    w = P.whiten(adv, d["mask"])
    vals = ret[m].tolist()
    mu = sum(vals) / len(vals)
    sd = math.sqrt(sum((x - mu) ** 2 for x in vals) / (len(vals) - 1) + 1e-8)
    assert torch.allclose(w[m], (ret[m] - mu) / sd, atol=TOL, rtol=0)
    assert float(P.whiten(adv, d["mask"], shift_mean=False)[m].mean()) == pytest.approx(mu)


def test_token_rewards_score_at_the_last_answer_token_and_kl_in_the_reward():
    d = rollout(3)
    got = P.token_rewards(d["score"], d["mask"], d["kl"], beta=0.05)
    for i in range(B):
        pos = answer_positions(d["mask"], i)
        for t in range(S):
            want = -0.05 * float(d["kl"][i, t]) if t in pos else 0.0
            want += float(d["score"][i]) if t == pos[-1] else 0.0
            assert float(got[i, t]) == pytest.approx(want, abs=TOL)


def test_dual_clip_policy_term():
    g = torch.Generator().manual_seed(4)
    ratio = torch.exp(torch.randn(B, S, generator=g, dtype=torch.float64))
    adv = torch.randn(B, S, generator=g, dtype=torch.float64) * 2
    got = L.policy_terms(torch.log(ratio), adv, 0.2, 0.28, dual_clip=3.0)
    for i in range(B):
        for t in range(S):
            r, a = float(ratio[i, t]), float(adv[i, t])
            want = max(-a * r, -a * min(max(r, 0.8), 1.28))
            if a < 0:
                want = min(want, -a * 3.0)
            assert float(got["pg"][i, t]) == pytest.approx(want, abs=TOL)
    assert float(got["dual_clipped"].sum()) > 0


def test_clipped_value_loss_and_explained_variance():
    d = rollout(5)
    g = torch.Generator().manual_seed(6)
    vpred = d["values"] + torch.randn(B, S, generator=g, dtype=torch.float64)
    _, ret = P.gae(d["rewards"], d["values"], d["mask"], 1.0, 0.95)
    got = P.value_loss(vpred, d["values"], ret, 0.5)
    for i in range(B):
        for t in answer_positions(d["mask"], i):
            v, old, r = float(vpred[i, t]), float(d["values"][i, t]), float(ret[i, t])
            vc = min(max(v, old - 0.5), old + 0.5)
            assert float(got["vf"][i, t]) == pytest.approx(0.5 * max((v - r) ** 2, (vc - r) ** 2))
            assert float(got["clipped"][i, t]) == float((vc - r) ** 2 > (v - r) ** 2)
    m = d["mask"] > 0
    gs, vs = ret[m].tolist(), vpred[m].tolist()

    def var(xs):
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)

    want = 1 - var([a - b for a, b in zip(gs, vs, strict=True)]) / (var(gs) + 1e-5)
    assert P.explained_variance(ret, vpred, d["mask"]) == pytest.approx(want, abs=TOL)
    assert P.explained_variance(ret, ret, d["mask"]) == pytest.approx(1.0, abs=1e-4)
