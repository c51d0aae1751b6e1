"""Rollout correction (verl's ``rollout_correction``, decoupled mode): the rollout samples with
π_rollout, the update's ratio is against the recomputed π_old, and the gap between the two is
corrected by importance weights on the policy term and/or by masking outlier tokens/sequences.

ℓ_t = log π_old − log π_rollout per answer token, clamped to ±20 before any exp:

- ``--rollout-is token``: w_t = min(exp ℓ_t, C); ``sequence``: w = min(exp Σ_t ℓ_t, C) for every
  token of the sequence (a product of ratios); C = ``--rollout-is-threshold``. Detached.
- ``--rollout-rs token|sequence|geometric``: a token (sequence) whose exp ℓ_t (exp Σ ℓ, exp
  mean ℓ) lies outside [L, U] leaves the loss, its count included; U =
  ``--rollout-rs-threshold`` (default C), L = ``--rollout-rs-threshold-lower`` (default 1/U).

Diagnostics on the original answer tokens (verl's names): ``rollout_corr/kl`` (mean of
log π_rollout − log π_old: KL(π_rollout‖π_old), k1), ``rollout_corr/k3_kl``,
``rollout_corr/chi2_token`` and ``rollout_corr/chi2_seq`` (E[ρ²] − 1 per token, per sequence),
``rollout_corr/rollout_is_mean`` (before truncation) and
``rollout_corr/rollout_rs_masked_fraction``.
In fp32 at the training layout ρ is 1 to ~1e-7 and the correction changes nothing measurable; it
matters in bf16 and for rollouts at another layout.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from anyspeed.errors import UsageError

IS_MODES = ("token", "sequence")
RS_MODES = ("token", "sequence", "geometric")
SAFETY = 20.0  # verl's bound on a log ratio before exp
METRICS = (
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/chi2_token",
    "rollout_corr/chi2_seq",
    "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_rs_masked_fraction",
)


@dataclass(frozen=True)
class Correction:
    """The checked rollout-correction flags (``None`` levels: off)."""

    is_level: str | None
    is_threshold: float
    rs_level: str | None
    rs_upper: float
    rs_lower: float


def add_arguments(g: Any) -> None:
    """The rollout-correction flags (verl's ``rollout_correction`` names)."""
    a = g.add_argument
    a(
        "--rollout-is",
        choices=IS_MODES,
        default=None,
        help="importance weights pi_old/pi_rollout on the policy term, per token or sequence",
    )
    a("--rollout-is-threshold", type=float, default=2.0, help="their upper cap C (truncation)")
    a(
        "--rollout-rs",
        choices=RS_MODES,
        default=None,
        help="leave out tokens / sequences whose ratio (geometric: mean log) is outside [L, U]",
    )
    a("--rollout-rs-threshold", type=float, default=None, help="U (default --rollout-is-threshold)")
    a("--rollout-rs-threshold-lower", type=float, default=None, help="L (default 1/U)")


def from_args(args: argparse.Namespace) -> Correction | None:
    """The correction of a run, checked; None when neither weights nor masking is asked for."""
    if args.rollout_is is None and args.rollout_rs is None:
        for flag in ("rollout_rs_threshold", "rollout_rs_threshold_lower"):
            if getattr(args, flag) is not None:
                name = "--" + flag.replace("_", "-")
                raise UsageError(f"{name} without --rollout-rs: give --rollout-rs or drop {name}")
        return None
    upper = args.rollout_rs_threshold or args.rollout_is_threshold
    lower = args.rollout_rs_threshold_lower
    lower = 1.0 / upper if lower is None else lower
    if args.rollout_rs is not None and not lower < upper:
        raise UsageError(
            f"--rollout-rs-threshold-lower {lower:g} must be below --rollout-rs-threshold "
            f"{upper:g} (the kept ratios lie between them)"
        )
    return Correction(args.rollout_is, args.rollout_is_threshold, args.rollout_rs, upper, lower)


def _log_ratio(b: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ℓ clamped, per-sequence Σ ℓ clamped, answer mask) of a micro-batch."""
    mask = b["answer_mask"]
    ell = (b["old_logp"] - b["rollout_logp"]).double() * mask
    return ell.clamp(-SAFETY, SAFETY), ell.sum(-1).clamp(-SAFETY, SAFETY), mask


def apply(b: dict[str, Any], c: Correction) -> None:
    """Set a micro-batch's importance weights (``is_weight``) and drop rejected tokens from its
    ``loss_mask``; its original answer tokens stay in ``answer_mask`` for the diagnostics."""
    mask = b["loss_mask"]
    b["answer_mask"] = mask.clone()
    ell, seq, _ = _log_ratio(b)
    if c.is_level is not None:
        w = torch.exp(ell) if c.is_level == "token" else torch.exp(seq)[:, None].expand_as(ell)
        b["is_weight"] = (w.clamp(max=c.is_threshold) * mask).to(mask.dtype).detach()
    if c.rs_level is not None:
        if c.rs_level == "token":
            stat = torch.exp(ell)
        elif c.rs_level == "sequence":
            stat = torch.exp(seq)[:, None].expand_as(ell)
        else:
            n = mask.sum(-1).clamp(min=1)
            stat = torch.exp((ell.sum(-1) / n).clamp(-SAFETY, SAFETY))[:, None].expand_as(ell)
        keep = (stat >= c.rs_lower) & (stat <= c.rs_upper)
        b["loss_mask"] = mask * keep.to(mask.dtype)


def diagnostics(b: dict[str, Any], c: Correction) -> dict[str, torch.Tensor]:
    """This micro-batch's (sum, count) of each of :data:`METRICS`: token means over the original
    answer tokens, ``chi2_seq`` over its sequences with an answer, ``rollout_is_mean`` of the
    weights before the cap (1 without ``--rollout-is``)."""
    ell, seq, mask = _log_ratio(b)
    raw = (b["old_logp"] - b["rollout_logp"]).double()
    m = mask.double()
    n = m.sum()
    has = (m.sum(-1) > 0).double()
    if c.is_level == "sequence":
        weight = torch.exp(seq)[:, None].expand_as(ell)
    else:
        weight = torch.exp(ell) if c.is_level == "token" else torch.ones_like(ell)

    def tokens(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([(x * m).sum(), n])

    return {
        "rollout_corr/kl": tokens(-raw),
        "rollout_corr/k3_kl": tokens(torch.exp(raw) - raw - 1),
        "rollout_corr/chi2_token": tokens(torch.exp(2 * ell) - 1),
        "rollout_corr/chi2_seq": torch.stack([((torch.exp(2 * seq) - 1) * has).sum(), has.sum()]),
        "rollout_corr/rollout_is_mean": tokens(weight),
        "rollout_corr/rollout_rs_masked_fraction": tokens(1 - b["loss_mask"].double()),
    }
