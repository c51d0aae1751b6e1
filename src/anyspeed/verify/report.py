"""``anyspeed verify``'s command lines and verdict: the layout under test and the reference
derived from one training command line, and the per-step comparison of the two runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from anyspeed.argv import get_flag, pop_flag, set_flag
from anyspeed.verify.grads import differs, first_difference, worst

# The flags that choose a layout (flag -> takes a value): the reference leaves them out.
LAYOUT_FLAGS = {
    "--nproc-per-node": True,
    "--tensor-model-parallel-size": True,
    "--pipeline-model-parallel-size": True,
    "--num-layers-per-virtual-pipeline-stage": True,
    "--decoder-first-pipeline-num-layers": True,
    "--decoder-last-pipeline-num-layers": True,
    "--num-layer-list": True,  # MindSpeed-LLM's uneven stages
    "--schedules-method": True,  # DualPipeV
    "--dualpipev-dw-detach": False,
    "--expert-model-parallel-size": True,
    "--expert-tensor-parallel-size": True,
    "--context-parallel-size": True,
    "--context-parallel-algo": True,
    "--ulysses-degree-in-cp": True,
    "--ddp-bucket-size": True,
    "--sequence-parallel": False,
    "--use-distributed-optimizer": False,
    "--overlap-grad-reduce": False,
    "--overlap-param-gather": False,
    "--use-cp-send-recv-overlap": False,
}
# What a verification run does not do (flag -> takes a value): write checkpoints, logs or
# metrics of its own, or stop early.
RUN_FLAGS = {
    "--save": True,
    "--save-interval": True,
    "--exit-interval": True,
    "--exit-duration-in-mins": True,
    "--tensorboard-dir": True,
    "--metrics-file": True,
    "--exit-signal-handler": False,
}
# Dropout masks cannot be equal across layouts (each tensor-parallel rank draws its own).
SET_FLAGS = {"--hidden-dropout": "0", "--attention-dropout": "0", "--eval-iters": "0"}


def drop_flags(argv: Sequence[str], flags: dict[str, bool]) -> list[str]:
    """``argv`` without ``flags`` (``--x v``, ``--x=v`` and switches)."""
    out = list(argv)
    for flag, has_value in flags.items():
        if has_value:
            while flag in out or any(a.startswith(flag + "=") for a in out):
                _, out = pop_flag(out, flag)
        else:
            out = [a for a in out if a != flag]
    return out


def command_lines(
    argv: Sequence[str], steps: int, reference: Sequence[str]
) -> tuple[list[str], list[str]]:
    """(the layout under test, the reference): ``steps`` iterations each, no checkpoints,
    dropout off; the reference without the layout's flags, plus ``reference``."""
    run = drop_flags(argv, RUN_FLAGS)
    for flag, value in {**SET_FLAGS, "--train-iters": str(steps)}.items():
        run = set_flag(run, flag, value)
    ref = same_padded_vocab(run, drop_flags(run, LAYOUT_FLAGS), reference)
    return run, ref + list(reference)


def same_padded_vocab(
    run: Sequence[str], ref: Sequence[str], reference: Sequence[str]
) -> list[str]:
    """``ref`` padding the vocabulary as ``run`` does (unless ``reference`` sets the divisor):
    Megatron pads to a multiple of ``--make-vocab-size-divisible-by`` x TP (32,256 at TP4)."""
    tp_flag, div_flag = "--tensor-model-parallel-size", "--make-vocab-size-divisible-by"
    tp, tp_ref = (int(get_flag(a, tp_flag) or 1) for a in (run, reference))
    multiple = int(get_flag(run, div_flag) or 128) * tp
    fixed = get_flag(run, "--padded-vocab-size") or get_flag(reference, div_flag)
    if fixed or tp == tp_ref or multiple % tp_ref:
        return list(ref)
    return set_flag(ref, div_flag, str(multiple // tp_ref))


@dataclass(frozen=True)
class Tolerance:
    """Loss, grad norm and metrics: relative ``rtol``; each gradient tensor (L2 norms):
    ``|g - reference| <= grad_atol + grad_rtol * |reference|``."""

    rtol: float = 1e-5
    grad_rtol: float = 1e-4
    grad_atol: float = 1e-9


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _metric_fails(ref: dict[str, float], got: dict[str, float], rtol: float) -> list[str]:
    bad = []
    for k in sorted(set(ref) & set(got)):
        a, b = ref[k], got[k]
        if not (abs(a - b) <= rtol * max(abs(a), abs(b)) + 1e-7):
            bad.append(f"{k} {b:.7g} vs {a:.7g}")
    return bad


def _step_problems(r: dict[str, Any], g: dict[str, Any], tol: Tolerance) -> list[str]:
    out = []
    for key in ("loss", "grad_norm"):
        if _rel(r[key], g[key]) > tol.rtol:
            out.append(
                f"{key.replace('_', ' ')} {g[key]:.9g} vs {r[key]:.9g} (relative "
                f"difference {_rel(r[key], g[key]):.2e} > {tol.rtol:g})"
            )
    first = first_difference(g.get("grads", {}), tol.grad_rtol, tol.grad_atol)
    if first:
        name, diff, scale = first
        n = sum(differs(d, s, tol.grad_rtol, tol.grad_atol) for d, s in g["grads"].values())
        out.append(
            f"first differing gradient {name}: |difference| {diff:.3e} = "
            f"{diff / scale if scale else math.inf:.2e} x |reference| {scale:.3e} "
            f"({n} of {len(g['grads'])} tensors differ)"
        )
    return out


def verdict(
    ref: list[dict[str, Any]], got: list[dict[str, Any]], tol: Tolerance
) -> tuple[list[str], bool]:
    """The per-step table and the verdict lines; True when every step is within ``tol``.
    The task's metrics are shown where they differ, not judged: a share of counts (DPO's
    reward accuracy, a clip fraction) flips on a tie that rounding decides."""
    head = (
        f"{'step':>4} | {'loss (reference)':>16} {'loss (layout)':>16} {'rel diff':>9} | "
        f"{'grad norm (ref)':>15} {'grad norm':>12} {'rel diff':>9} | worst gradient"
    )
    lines = [head]
    failed: tuple[int, list[str]] | None = None
    notes = []
    for i, (r, g) in enumerate(zip(ref, got, strict=False)):
        w = worst(g.get("grads", {}))
        wtxt = f"{w[1]:.1e} {w[0]}" if w else "-"
        lines.append(
            f"{r['iteration']:>4} | {r['loss']:>16.9g} {g['loss']:>16.9g} "
            f"{_rel(r['loss'], g['loss']):>9.2e} | {r['grad_norm']:>15.7g} "
            f"{g['grad_norm']:>12.7g} {_rel(r['grad_norm'], g['grad_norm']):>9.2e} | "
            f"{wtxt}"
        )
        problems = _step_problems(r, g, tol)
        if problems and failed is None:
            failed = (i + 1, problems)
        diff = _metric_fails(r.get("metrics", {}), g.get("metrics", {}), tol.rtol)
        if diff:
            notes.append(f"step {i + 1}: " + ", ".join(diff))
    if notes:
        lines.append("metrics that differ (layout vs reference; not judged): " + "; ".join(notes))
    if len(got) != len(ref):
        return lines + [f"FAIL: the layout ran {len(got)} steps, the reference {len(ref)}"], False
    if failed:
        step, problems = failed
        hint = (
            ""
            if step == 1
            else " (step 1, from identical weights, passed: Adam turns "
            "rounding noise in near-zero gradients into lr-sized weight differences, so a "
            "later step can drift; a correct layout stays within tolerance at a lower --lr)"
        )
        return lines + [f"FAIL at step {step}: " + "; ".join(problems) + hint], False
    return lines + [
        f"PASS: {len(ref)} steps; loss and grad norm within {tol.rtol:g} (relative), "
        f"every gradient tensor within {tol.grad_rtol:g} of its norm"
    ], True
