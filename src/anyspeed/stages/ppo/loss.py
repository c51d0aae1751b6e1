"""PPO's objective with a critic, as verl computes it (``core_algos``), in plain tensor math:
token rewards (the KL penalty in the reward, the sequence reward at the last answer token),
generalised advantage estimation with the returns, whitening over the answer tokens and the
clipped value loss; and the critic's explained variance. The policy term (dual clip included)
is the RL stages' shared one, :func:`anyspeed.stages.common.rl.objective.policy_terms`.

Tensors are [b, s] over a micro-batch's positions with ``mask`` 1 on the answer tokens. Where
a mask has holes inside an answer (tool output in a multi-turn rollout) GAE follows verl: the
next value and the running advantage are carried across masked positions, which is where
MindSpeed-RL's form (the next position's value, masked or not) differs.
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8  # verl's masked_whiten
EXPLAINED_EPS = 1e-5  # verl's explained-variance denominator


def token_rewards(
    score: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards: each sequence's ``score`` [b] at its last answer token, minus
    ``beta`` x the per-token ``kl`` estimate (the KL penalty in the reward) on answer tokens."""
    rewards = torch.zeros_like(mask, dtype=score.dtype)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).amax(dim=1)
    has = last >= 0
    rewards[has.nonzero().squeeze(1), last[has]] = score[has]
    if kl is not None and beta:
        rewards = rewards - beta * kl * mask
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) by generalised advantage estimation, right to left:
    δ_t = r_t + γ V_next − V_t, A_t = δ_t + γλ A_next, returns = A + V; V_next and A_next are
    the nearest answer token's to the right (masked positions are skipped, verl's rule), 0
    past the end. The advantages are not whitened here (see :func:`whiten`)."""
    b, s = rewards.shape
    next_value = torch.zeros(b, dtype=values.dtype, device=values.device)
    running = torch.zeros(b, dtype=values.dtype, device=values.device)
    out = []
    m = mask.to(values.dtype)
    for t in reversed(range(s)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        running = torch.where(m[:, t] > 0, step, running)
        out.append(running)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages, advantages + values


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set."""
    return (x * mask).sum() / mask.sum()


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``x`` standardised over the masked positions: (x − mean) / sqrt(var + 1e-8) with the
    unbiased variance (verl's masked_whiten); ``shift_mean=False`` adds the mean back."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_mean((x - mean) ** 2, mask) * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    return out if shift_mean else out + mean


def value_loss(
    vpred: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> dict[str, torch.Tensor]:
    """Per-token clipped value loss ½·max((V − G)², (clip(V, V_old ± ε) − G)²) and whether the
    clipped error was the larger (verl's ``vf_clipfrac``)."""
    clipped = torch.maximum(torch.minimum(vpred, old_values + clip), old_values - clip)
    plain = (vpred - returns) ** 2
    bounded = (clipped - returns) ** 2
    return {
        "vf": 0.5 * torch.maximum(plain, bounded),
        "clipped": (bounded > plain).to(vpred.dtype),
    }


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(G − V) / (Var(G) + 1e-5) over the answer tokens (unbiased variances): how much
    of the returns' spread the critic predicts (1: all; 0: no better than their mean)."""
    keep = mask > 0
    g, v = returns[keep].double(), values[keep].double()
    return float(1.0 - torch.var(g - v) / (torch.var(g) + EXPLAINED_EPS))
