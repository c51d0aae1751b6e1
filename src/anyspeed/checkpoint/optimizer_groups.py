"""Optimizer state saved by one chain of optimizers, loaded into another.

Megatron-Core gives expert parameters an optimizer of their own only when experts are spread
over ranks (EP > 1): a run saved at EP2 holds two optimizers' state, a run at EP1 has one. With
the distributed optimizer's model-space format the tensors (moments, master weights) are keyed
by parameter and load in either case; what differs is the small per-optimizer part: its param
groups, which Megatron matches by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr).
:func:`regroup` rebuilds that part for the optimizer of this run.
"""

from __future__ import annotations

from typing import Any


def _parts(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _saved_entries(loaded: dict[Any, Any]) -> list[dict[str, Any]]:
    """The saved per-optimizer common parts: one (a single optimizer) or one per chained index
    (the distributed optimizer's under ``optimizer``, a plain one's ``param_groups`` at top;
    a chain of a plain and a distributed one, e.g. Muon's, mixes both)."""
    chained = [loaded[k] for k in sorted(k for k in loaded if isinstance(k, int))]
    flat = {k: v for k, v in loaded.items() if not isinstance(k, int)}
    per_part = all("optimizer" in c or "param_groups" in c for c in chained)
    return chained if chained and per_part else [flat]


def _all_groups(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every saved param group, plus each with ``is_expert_parallel`` flipped: a group of
    expert parameters at EP2 is an ordinary group at EP1 (same hyper-parameters and step)."""
    groups = [g for e in entries for g in e.get("optimizer", {}).get("param_groups", [])]
    flipped = [{**g, "is_expert_parallel": not g.get("is_expert_parallel", False)} for g in groups]
    return groups + flipped


def needs_regroup(loaded: dict[Any, Any], optimizer: Any) -> bool:
    """Whether the saved state was written by a different number of chained optimizers."""
    return len(_saved_entries(loaded)) != len(_parts(optimizer))


def regroup(loaded: dict[Any, Any], optimizer: Any) -> dict[Any, Any]:
    """``loaded`` (saved common part merged with this run's requested tensors) in the shape
    this run's optimizer loads: per optimizer, its tensors and the saved param groups."""
    entries = _saved_entries(loaded)
    template = {k: v for k, v in entries[0].items() if k not in ("optimizer", "param_state")}
    groups = _all_groups(entries)
    optimizer_part = {**entries[0].get("optimizer", {}), "param_groups": groups}
    parts = _parts(optimizer)
    if len(parts) == 1:
        tensors = {k: v for k, v in loaded.items() if not isinstance(k, int) and k != "optimizer"}
        return {**template, **tensors, "optimizer": optimizer_part}
    out: dict[Any, Any] = {}
    for i in range(len(parts)):
        tensors = {k: v for k, v in loaded[i].items() if k != "optimizer"}
        out[i] = {**template, **tensors, "optimizer": optimizer_part}
    return out
