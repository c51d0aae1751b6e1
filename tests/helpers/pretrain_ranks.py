"""Pretraining runs inside spawned ranks (importable by name for spawn)."""

from __future__ import annotations


def pretrain(cli: list[str], crash_on_save: int | None = None, nan_at: int | None = None) -> dict:
    """Run ``anyspeed pretrain`` with ``cli`` in this rank; return its history (no trainer).

    Faults come through the loop's FaultInjection hook: ``crash_on_save=N`` kills the process
    (``os._exit(17)``) after the N-th checkpoint's data is written but before it is renamed into
    place; ``nan_at=N`` turns one weight into NaN just before iteration N (a diverging run).
    """
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train
    from anyspeed.training.hooks import FaultInjection

    args, _ = prepare(cli)
    faults = FaultInjection(nan_at=nan_at, crash_on_save=crash_on_save)
    history = train(args, task_for(args), extra_hooks=[faults])
    history.pop("trainer")
    return history


def pretrain_many(clis: list[list[str]]) -> list[dict]:
    """:func:`pretrain` for each command line in turn, in one process group (same features)."""
    return [pretrain(cli) for cli in clis]
