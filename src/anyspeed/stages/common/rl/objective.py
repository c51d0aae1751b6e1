"""The GRPO objective, exactly and selectably: group-normalised advantages, the clipped
policy-gradient term (DAPO's asymmetric clip) on a token or a sequence ratio (GSPO), the KL
penalty against a frozen reference, the entropy bonus, and the aggregation of per-token terms
into a loss.

Pure tensor math shared by the GRPO task and its reference tests. Every aggregation is returned
as (sum, count) for one micro-batch: Megatron's schedule (``calculate_per_token_loss``) adds the
sums and counts of every micro-batch and rank and divides the gradients once, so each mode is
exact at every layout:

- ``token-mean`` (default): every response token of the global batch weighs the same;
- ``seq-mean-token-mean``: each sequence's token mean, then the mean over the global batch's
  sequences (TRL's ``grpo``; its length bias);
- ``seq-mean-token-sum-norm``: each sequence's token sum over ``max_response_length``, mean over
  sequences (Dr. GRPO's constant normaliser);
- ``micro-token-mean``: each micro-batch's token mean, then the mean over micro-batches
  (MindSpeed-RL's form; it changes with the micro-batch size and the layout).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "micro-token-mean")
KL_PENALTIES = ("low_var_kl", "kl", "mse")  # k3, k1, k2
GROUP_ADVANTAGES = ("group_norm", "group_mean")  # GRPO; Dr. GRPO (no division by the std)
ADVANTAGES = (*GROUP_ADVANTAGES, "gae")  # gae: a critic's (PPO)
ADV_EPS = 1e-6  # MindSpeed-RL's epsilon in (r - mean) / (std + eps)
IS_LEVELS = ("token", "sequence", "sequence_token")  # TRL's importance_sampling_level names


def group_advantages(
    rewards: torch.Tensor, group: int, estimator: str = "group_norm", eps: float = ADV_EPS
) -> torch.Tensor:
    """Per-sample advantages of ``rewards`` [n] laid out as consecutive groups of ``group``
    samples of one prompt: (r - mean) / (std + eps) with the unbiased std (``group_norm``), or
    r - mean (``group_mean``). A group with equal rewards gets 0 everywhere."""
    r = rewards.double().view(-1, group)
    centred = r - r.mean(dim=1, keepdim=True)
    if estimator == "group_mean":
        return centred.view(-1)
    if estimator != "group_norm":
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    std = r.std(dim=1, keepdim=True) if group > 1 else torch.zeros_like(r[:, :1])
    return (centred / (std + eps)).view(-1)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference: ``low_var_kl`` (k3, MindSpeed-RL's
    clamps: log-ratio to ±20, value to ±10), ``kl`` (k1), ``mse`` (k2)."""
    if kind == "low_var_kl":
        kl = (ref_logp - logp).clamp(-20, 20)
        return (torch.exp(kl) - kl - 1).clamp(-10, 10)
    if kind == "kl":
        return logp - ref_logp
    if kind == "mse":
        return 0.5 * (logp - ref_logp) ** 2
    raise ValueError(f"unknown KL penalty {kind!r}")


def log_importance(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-token log importance weight of the policy against the old one ([b, s]): each token's
    log ratio (``token``: PPO, GRPO); its sequence's mean log ratio over the answer tokens
    (``sequence``: GSPO, one ratio a sequence); or that mean's value with each token's own
    gradient (``sequence_token``: GSPO-token). ``reduce`` sums the per-sequence [2, b] sums
    over the ranks that share a sequence (context parallelism)."""
    token = logp - old_logp
    if level == "token":
        return token
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance sampling level {level!r}")
    sums = torch.stack([(token * mask).sum(-1), mask.sum(-1)])
    sums = reduce(sums) if reduce is not None else sums
    seq = (sums[0] / sums[1].clamp(min=1))[:, None]
    if level == "sequence":
        return seq.expand_as(token)
    return seq.detach() + logp - logp.detach()


def policy_terms(
    log_w: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token clipped policy-gradient loss max(-A·w, -A·clip(w, 1-ε_low, 1+ε_high)) with
    w = exp(``log_w``) (see :func:`log_importance`) and whether the clip was active. With
    ``dual_clip`` c (dual-clip PPO, verl's ``clip_ratio_c``) the term of a negative advantage
    is at most -A·c, so a huge ratio cannot make one token's loss unbounded."""
    ratio = torch.exp(log_w)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    out = {"pg": pg, "clipped": (clipped > unclipped).to(pg.dtype), "ratio": ratio}
    if dual_clip is not None:
        lower = (adv < 0) & (-adv * dual_clip < pg)
        out["pg"] = torch.where(lower, -adv * dual_clip, pg)
        out["dual_clipped"] = lower.to(pg.dtype)
    return out


def aggregate(
    seq_sum: torch.Tensor, seq_tokens: torch.Tensor, mode: str, max_response_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) under ``mode`` (see the module doc) of one micro-batch, from each
    sequence's sum of per-token values and its response-token count ([b] each); sequences
    without a response token are left out of the sequence modes."""
    if mode == "token-mean":
        return seq_sum.sum(), seq_tokens.sum()
    if mode == "micro-token-mean":
        n = seq_tokens.sum()
        return seq_sum.sum() / n.clamp(min=1), (n > 0).to(seq_sum.dtype)
    has = (seq_tokens > 0).to(seq_sum.dtype)
    if mode == "seq-mean-token-mean":
        return (seq_sum / seq_tokens.clamp(min=1) * has).sum(), has.sum()
    if mode == "seq-mean-token-sum-norm":
        return (seq_sum / max_response_length * has).sum(), has.sum()
    raise ValueError(f"unknown loss aggregation {mode!r}")
