"""The training loop: steps until ``train_iters``, with hook objects around each step.

Logging, evaluation, checkpoints, the NaN guard and (in tests) fault injection are
:class:`Hook` objects (:mod:`anyspeed.training.hooks`), so a task or a test changes what
happens around a step by passing hooks, never by patching the loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoopState:
    """What the loop and its hooks share: the step, the position in the data, the history."""

    trainer: Any
    scheduler: Any
    train_iters: int
    global_batch_size: int
    iteration: int = 0
    start_iteration: int = 0
    consumed: int = 0  # training samples consumed so far (the data position)
    consumed_valid: int = 0
    fp16: bool = False
    hooks: Sequence[Hook] = ()
    history: dict[str, Any] = field(
        default_factory=lambda: {
            "iterations": [],
            "loss": [],
            "grad_norm": [],
            "lr": [],
            "valid": [],
            "saved": [],
            "skipped": [],
            "loss_scale": [],
        }
    )

    def notify(self, event: str, *args: Any) -> None:
        """Call ``on_<event>(self, *args)`` on every hook that has it."""
        for hook in self.hooks:
            fn = getattr(hook, f"on_{event}", None)
            if fn is not None:
                fn(self, *args)


class Hook:
    """Override what you need; every method is called on every hook, in list order."""

    def on_start(self, state: LoopState) -> None:
        """Before the first step."""

    def before_step(self, state: LoopState) -> None:
        """Before each step (``state.iteration`` is the last finished one)."""

    def after_step(self, state: LoopState, out: dict[str, Any]) -> None:
        """After each step; ``out`` has loss, grad_norm, ok, lr."""

    def should_stop(self, state: LoopState) -> bool:
        """Stop early after this step (e.g. ``--exit-interval``)."""
        return False

    def on_end(self, state: LoopState, completed: bool) -> None:
        """After the last step; ``completed``: ``train_iters`` was reached."""

    def on_abort(self, state: LoopState) -> None:
        """The run stopped with an error: release what ``on_start`` took (a directory lock)."""


class DataExhausted(RuntimeError):
    """The training split ran out before ``train_iters``."""


def run(state: LoopState, batches: Iterator[list[dict]], hooks: Sequence[Hook]) -> LoopState:
    """Train from ``state.iteration`` to ``state.train_iters`` with ``hooks``."""
    state.hooks = list(hooks)
    state.start_iteration = state.iteration
    state.trainer.iteration = state.iteration
    for h in state.hooks:
        h.on_start(state)
    try:
        _loop(state, batches)
    except BaseException:
        for h in state.hooks:
            try:
                h.on_abort(state)
            except Exception:  # noqa: BLE001 - the run's own error is the one to report
                pass
        raise
    return state


def _loop(state: LoopState, batches: Iterator[list[dict]]) -> None:
    while state.iteration < state.train_iters:
        mbs = next(batches, None)
        if mbs is None:
            raise DataExhausted(
                f"training data exhausted at iteration {state.iteration} (check --split)"
            )
        for h in state.hooks:
            h.before_step(state)
        out = state.trainer.step(mbs)
        state.iteration += 1
        state.scheduler.step(increment=state.global_batch_size)
        state.consumed += state.global_batch_size
        out["lr"] = state.trainer.optimizer.param_groups[0]["lr"]
        _record(state, out)
        for h in state.hooks:
            h.after_step(state, out)
        if any(h.should_stop(state) for h in state.hooks):
            break
    completed = state.iteration == state.train_iters
    for h in state.hooks:
        h.on_end(state, completed)


def _record(state: LoopState, out: dict[str, Any]) -> None:
    h = state.history
    if not math.isfinite(out["loss"]):
        return  # the NaN guard reports it; a diverged step is not history
    h["iterations"].append(state.iteration)
    h["loss"].append(out["loss"])
    h["grad_norm"].append(out["grad_norm"])
    h["lr"].append(out["lr"])
    for name, value in out.get("metrics", {}).items():  # the task's named metrics
        h.setdefault("metrics", {}).setdefault(name, []).append(value)
    if not out["ok"]:  # fp16 overflow: Megatron skipped the update and lowered the scale
        h["skipped"].append(state.iteration)
    if state.fp16:
        h["loss_scale"].append(float(state.trainer.optimizer.get_loss_scale()))
