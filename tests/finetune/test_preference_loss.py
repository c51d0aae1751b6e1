"""The preference objectives against hand-written formulas on fixed log-probabilities (plain
Python math, float64), and TRL's invariant: with the reference equal to the policy the DPO
loss is ln 2."""

from __future__ import annotations

import math

import pytest
import torch

from anyspeed.stages.preference import loss as P

TOL = 1e-7
PC, PR = [-12.5, -30.0, -7.25], [-14.0, -21.5, -9.0]  # policy sums
RC, RR = [-13.0, -28.0, -7.0], [-13.5, -23.0, -8.0]  # reference sums
NC, NR = [5.0, 11.0, 3.0], [6.0, 8.0, 4.0]  # answer token counts


def logps(pc=PC, pr=PR, rc=RC, rr=RR) -> P.PairLogps:
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return P.PairLogps(t(pc), t(pr), t(rc), t(rr), t(NC), t(NR))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def hand(kind: str, beta: float, eps: float = 0.0, ftx: float = 0.0) -> list[float]:
    out = []
    for pc, pr, rc, rr, nc, nr in zip(PC, PR, RC, RR, NC, NR, strict=True):
        if kind == "ipo":
            d = (pc / nc - rc / nc) - (pr / nr - rr / nr)
            loss = (d - 1 / (2 * beta)) ** 2
        else:
            d = (pc - rc) - (pr - rr)
            if kind == "sigmoid":
                loss = -(1 - eps) * logsig(beta * d) - eps * logsig(-beta * d)
            else:
                loss = max(0.0, 1 - beta * d)
        out.append(loss + ftx * (-pc / nc))
    return out


@pytest.mark.parametrize("kind", ["sigmoid", "hinge", "ipo"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_losses_equal_formulas(kind, beta):
    losses, rc, rr = P.dpo_loss(logps(), kind, beta)
    assert losses.tolist() == pytest.approx(hand(kind, beta), abs=TOL)
    if kind != "ipo":
        assert rc.tolist() == pytest.approx(
            [beta * (a - b) for a, b in zip(PC, RC, strict=True)], abs=TOL
        )
        assert rr.tolist() == pytest.approx(
            [beta * (a - b) for a, b in zip(PR, RR, strict=True)], abs=TOL
        )


def test_label_smoothing_and_pref_ftx():
    losses, _, _ = P.dpo_loss(logps(), "sigmoid", 0.2, label_smoothing=0.3, pref_ftx=0.7)
    assert losses.tolist() == pytest.approx(hand("sigmoid", 0.2, 0.3, 0.7), abs=TOL)
    losses, _, _ = P.dpo_loss(logps(), "hinge", 0.2, pref_ftx=0.5)
    assert losses.tolist() == pytest.approx(hand("hinge", 0.2, 0, 0.5), abs=TOL)


def test_reference_equal_to_policy_gives_ln2():
    losses, rc, rr = P.dpo_loss(logps(rc=PC, rr=PR), "sigmoid", 0.1)
    assert losses.tolist() == pytest.approx([math.log(2)] * 3, abs=1e-6)
    assert rc.abs().max() == 0 and rr.abs().max() == 0


@pytest.mark.parametrize("kind", ["sigmoid", "hinge", "ipo"])
def test_simpo_equals_formula(kind):
    beta, ratio, eps = 2.5, 1.4, 0.1 if kind == "sigmoid" else 0.0
    losses, rc, _ = P.simpo_loss(logps(), kind, beta, ratio, eps)
    want = []
    for pc, pr, nc, nr in zip(PC, PR, NC, NR, strict=True):
        z = pc / nc - pr / nr - ratio
        if kind == "sigmoid":
            want.append(-(1 - eps) * logsig(beta * z) - eps * logsig(-beta * z))
        elif kind == "hinge":
            want.append(max(0.0, 1 - beta * z))
        else:
            want.append((z - 1 / (2 * beta)) ** 2)
    assert losses.tolist() == pytest.approx(want, abs=TOL)
    assert rc.tolist() == pytest.approx(
        [beta * a / n for a, n in zip(PC, NC, strict=True)], abs=TOL
    )


def test_orm_loss_and_metrics():
    sc = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    sr = torch.tensor([0.0, 0.5, 2.5], dtype=torch.float64)
    losses, _, _ = P.orm_loss(sc, sr)
    assert losses.tolist() == pytest.approx(
        [-logsig(a - b) for a, b in zip(sc, sr, strict=True)], abs=TOL
    )
    m = P.pair_metrics(sc, sr, None)
    assert m["rewards/accuracies"].tolist() == [1.0, 3.0]
    assert m["rewards/margins"].tolist() == pytest.approx([-0.5, 3.0])
