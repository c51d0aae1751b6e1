"""The pairwise preference objectives (DPO's sigmoid / hinge / IPO with cDPO label smoothing,
SimPO, the outcome reward model), per pair, from sequence log-probabilities or scores.

Pure tensor math, shared by the preference task and its closed-form tests. Inputs are per-pair
tensors [n]; each function returns the per-pair losses and the per-pair rewards (detached) the
metrics report. The task sums the losses over a global batch and divides once (a global pair
mean, the same at every layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DPO_LOSSES = ("sigmoid", "hinge", "ipo")
SIMPO_LOSSES = ("sigmoid", "hinge", "ipo")


@dataclass(frozen=True)
class PairLogps:
    """Summed log-probabilities of the chosen and rejected answers and their token counts;
    ``ref_*`` are the reference model's (zeros where there is none)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    n_chosen: torch.Tensor
    n_rejected: torch.Tensor


def _margin_loss(
    x: torch.Tensor, loss_type: str, beta: float, label_smoothing: float
) -> torch.Tensor:
    """The loss of a preference margin ``x``: sigmoid -(1-ε)·log σ(βx) - ε·log σ(-βx) (cDPO's
    conservative form; ε=0: DPO's), hinge relu(1 - βx), ipo (x - 1/(2β))²."""
    if loss_type == "sigmoid":
        z, eps = beta * x, label_smoothing
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if loss_type == "hinge":
        return torch.relu(1 - beta * x)
    if loss_type == "ipo":
        return (x - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown preference loss type {loss_type!r}")


def dpo_loss(
    lp: PairLogps, loss_type: str, beta: float, label_smoothing: float = 0.0, pref_ftx: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, chosen rewards, rejected rewards) per pair.

    With Δ = (π_c - ref_c) - (π_r - ref_r): sigmoid -(1-ε)·logσ(βΔ) - ε·logσ(-βΔ); hinge
    relu(1 - βΔ); ipo (Δ - 1/(2β))² on length-averaged log-probs. ``pref_ftx`` adds that
    multiple of the chosen answer's SFT loss (its negative mean token log-prob).
    """
    pc, pr, rc, rr = lp.chosen, lp.rejected, lp.ref_chosen, lp.ref_rejected
    nc, nr = lp.n_chosen.clamp(min=1), lp.n_rejected.clamp(min=1)
    if loss_type == "ipo":  # IPO compares mean token log-probs
        pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
    losses = _margin_loss((pc - rc) - (pr - rr), loss_type, beta, label_smoothing)
    if pref_ftx:
        losses = losses + pref_ftx * (-lp.chosen / nc)
    return losses, (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach()


def simpo_loss(
    lp: PairLogps,
    loss_type: str,
    beta: float,
    gamma_beta_ratio: float,
    label_smoothing: float = 0.0,
    pref_ftx: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (no reference): z = avg_c - avg_r - γ/β on mean token log-probs; sigmoid
    -(1-ε)·logσ(βz) - ε·logσ(-βz), hinge relu(1 - βz), ipo (z - 1/(2β))². Rewards are β·avg."""
    nc, nr = lp.n_chosen.clamp(min=1), lp.n_rejected.clamp(min=1)
    ac, ar = lp.chosen / nc, lp.rejected / nr
    losses = _margin_loss(ac - ar - gamma_beta_ratio, loss_type, beta, label_smoothing)
    if pref_ftx:
        losses = losses + pref_ftx * (-ac)
    return losses, (beta * ac).detach(), (beta * ar).detach()


def orm_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outcome reward model's pairwise loss -log σ(s_c - s_r) on scalar scores."""
    return -F.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach()


def pair_metrics(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, lp: PairLogps | None
) -> dict[str, torch.Tensor]:
    """Per-pair sums of TRL's metric names (``[sum, count]`` pairs: one global mean each)."""
    n = torch.tensor(float(chosen_rewards.numel()), device=chosen_rewards.device)

    def pair(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x.detach().double().sum(), n.double()])

    out = {
        "rewards/chosen": pair(chosen_rewards),
        "rewards/rejected": pair(rejected_rewards),
        "rewards/accuracies": pair((chosen_rewards > rejected_rewards).double()),
        "rewards/margins": pair(chosen_rewards - rejected_rewards),
    }
    if lp is not None:
        out["logps/chosen"] = pair(lp.chosen)
        out["logps/rejected"] = pair(lp.rejected)
    return out
