"""Megatron-LM's ``--manual-gc``: Python's garbage collector off its allocation thresholds, run
every ``--manual-gc-interval`` steps instead (0: never between steps) and after each
validation unless ``--no-manual-gc-eval``, so collections fall on the same step on every rank
(MindSpeed-LLM's recipes pass ``--manual-gc --manual-gc-interval 50``)."""

from __future__ import annotations

import argparse
import gc
from typing import Any

from anyspeed.training.loop import Hook, LoopState


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags, Megatron-LM's names and defaults."""
    g = p.add_argument_group("garbage collection")
    g.add_argument("--manual-gc", action="store_true", help="collect at fixed steps only")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="steps between collections")
    no_eval = "no collection after validation"
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false", help=no_eval)


class ManualGC(Hook):
    """Collections at fixed steps; the collector's automatic mode is restored at the end."""

    def __init__(self, interval: int, eval_interval: int | None) -> None:
        self.interval, self.eval_interval = interval, eval_interval
        self.was_enabled = gc.isenabled()
        self.collections = 0

    def _collect(self) -> None:
        gc.collect()
        self.collections += 1

    def on_start(self, state: LoopState) -> None:
        gc.disable()
        self._collect()

    def after_step(self, state: LoopState, out: dict[str, Any]) -> None:
        it = state.iteration
        if (self.interval and it % self.interval == 0) or (
            self.eval_interval and it % self.eval_interval == 0
        ):
            self._collect()

    def _restore(self) -> None:
        if self.was_enabled:
            gc.enable()

    def on_end(self, state: LoopState, completed: bool) -> None:
        self._restore()

    def on_abort(self, state: LoopState) -> None:
        self._restore()


def hooks(args: argparse.Namespace) -> list[Hook]:
    """The hook ``--manual-gc`` asks for (none without it)."""
    if not getattr(args, "manual_gc", False):
        return []
    evals = args.eval_interval if args.manual_gc_eval and args.eval_iters else None
    return [ManualGC(args.manual_gc_interval, evals)]
