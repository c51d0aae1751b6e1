"""The training loop and its hooks, on a stand-in step (no Megatron): order of the calls,
early exit, the NaN guard and running out of data."""

from __future__ import annotations

import argparse
import math

import pytest

from anyspeed.training import hooks as H
from anyspeed.training.loop import DataExhausted, Hook, LoopState, run


class FakeStep:
    """A step whose loss is given per iteration; records the micro-batches it was handed."""

    def __init__(self, losses: list[float]) -> None:
        self.losses, self.seen, self.iteration = losses, [], 0
        self.optimizer = argparse.Namespace(param_groups=[{"lr": 0.5}])

    def step(self, mbs):
        self.seen.append(mbs)
        loss = self.losses[len(self.seen) - 1]
        return {"loss": loss, "grad_norm": 1.0, "ok": True}


class Scheduler:
    def __init__(self) -> None:
        self.samples = 0

    def step(self, increment: int) -> None:
        self.samples += increment


class Recorder(Hook):
    def __init__(self, log: list) -> None:
        self.log = log

    def on_start(self, state):
        self.log.append(("start", state.iteration))

    def before_step(self, state):
        self.log.append(("before", state.iteration))

    def after_step(self, state, out):
        self.log.append(("after", state.iteration, out["loss"]))

    def on_end(self, state, completed):
        self.log.append(("end", state.iteration, completed))


def _state(losses: list[float], iters: int, start: int = 0) -> LoopState:
    return LoopState(FakeStep(losses), Scheduler(), iters, 4, iteration=start, consumed=4 * start)


def test_hooks_run_in_order_and_the_history_is_kept():
    log: list = []
    state = run(_state([3.0, 2.0, 1.0], 5, start=2), iter(["a", "b", "c"]), [Recorder(log)])
    assert log == [
        ("start", 2),
        ("before", 2),
        ("after", 3, 3.0),
        ("before", 3),
        ("after", 4, 2.0),
        ("before", 4),
        ("after", 5, 1.0),
        ("end", 5, True),
    ]
    assert state.history["iterations"] == [3, 4, 5] and state.history["loss"] == [3.0, 2.0, 1.0]
    assert state.consumed == 20 and state.scheduler.samples == 12
    assert state.trainer.seen == ["a", "b", "c"]


def test_a_hook_stops_the_run_early():
    class StopAt(Hook):
        def should_stop(self, state):
            return state.iteration == 2

    log: list = []
    state = run(_state([1.0] * 5, 5), iter("abcde"), [Recorder(log), StopAt()])
    assert state.iteration == 2 and log[-1] == ("end", 2, False)


def test_nan_guard_stops_without_recording_the_bad_step(tmp_path):
    with pytest.raises(H.NonFiniteLoss, match="loss is nan at iteration 2; stopping"):
        run(_state([1.0, math.nan, 1.0], 3), iter("abc"), [H.NanGuard(str(tmp_path))])


def test_running_out_of_data_is_an_error():
    with pytest.raises(DataExhausted, match="exhausted at iteration 2"):
        run(_state([1.0] * 3, 3), iter("ab"), [])
