"""Megatron-LM's ``--manual-gc`` / ``--manual-gc-interval`` / ``--no-manual-gc-eval`` and
``--exit-on-missing-checkpoint`` (MindSpeed-LLM's recipes pass both)."""

from __future__ import annotations

import argparse
import gc

import pytest

from anyspeed.training.loop import LoopState
from anyspeed.training.manual_gc import ManualGC, hooks


def _args(**kw) -> argparse.Namespace:
    base = {"manual_gc": True, "manual_gc_interval": 3, "manual_gc_eval": True,
            "eval_interval": 5, "eval_iters": 2}  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def _steps(hook: ManualGC, n: int) -> list[bool]:
    """Whether each of ``n`` steps collected, and that the collector was off meanwhile."""
    state = LoopState.__new__(LoopState)
    state.iteration = 0
    hook.on_start(state)
    done = []
    for it in range(1, n + 1):
        assert not gc.isenabled()
        state.iteration = it
        before = hook.collections
        hook.after_step(state, {})
        done.append(hook.collections > before)
    hook.on_end(state, True)
    return done


def test_collections_fall_on_the_interval_and_after_validation():
    was = gc.isenabled()
    (hook,) = hooks(_args())
    got = _steps(hook, 10)
    assert [i + 1 for i, c in enumerate(got) if c] == [3, 5, 6, 9, 10]
    assert gc.isenabled() == was  # the automatic collector is back
    (hook,) = hooks(_args(manual_gc_interval=0, manual_gc_eval=False))
    assert not any(_steps(hook, 10)) and hook.collections == 1  # the one at start
    assert hooks(_args(manual_gc=False)) == []


def test_exit_on_missing_checkpoint_is_one_line(tmp_path):
    from anyspeed.errors import UsageError
    from anyspeed.stages.arguments import parse_pretrain_args
    from anyspeed.stages.checks import check, complete
    from anyspeed.training.run import freeze

    argv = ("--model tiny-qwen2.5 --mock-data --vocab-size 512 --seq-length 64 --train-iters 2 "
            "--lr 1e-3 --global-batch-size 8 --micro-batch-size 2").split()  # fmt: skip
    argv += ["--load", str(tmp_path), "--exit-on-missing-checkpoint"]
    args = parse_pretrain_args(argv)
    tok = complete(args)
    freeze(args)
    with pytest.raises(UsageError, match="no checkpoint .* --exit-on-missing-checkpoint is set"):
        check(args, 1, None, tok)
