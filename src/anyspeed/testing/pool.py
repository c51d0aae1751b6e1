"""Ranks kept alive between :func:`anyspeed.testing.run_distributed` calls (a test session).

Starting a rank costs seconds (torch, Megatron-Core and anyspeed imported afresh) and most
distributed tests spend more time starting than running. With ``ANYSPEED_SHARED_RANKS=1`` (the
test suite's conftest sets it) each world size keeps one set of ranks: every call sends its
function to them with a fresh port, and after it the ranks tear down the process group,
Megatron's parallel state and the adaptor's patches, so the next call starts as a new process
would (its own seed, its own features). A rank that fails, dies or times out ends its whole set;
the next call starts a new one. ``fresh=True`` always starts new ranks.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from anyspeed.device.jit import keep_megatron_jit_off
from anyspeed.testing import forkserver
from anyspeed.testing.faults import crash_report, record_faults

ENV = "ANYSPEED_SHARED_RANKS"


def enabled() -> bool:
    """Whether calls share ranks (``ANYSPEED_SHARED_RANKS=1``)."""
    return os.environ.get(ENV) == "1"


def _reset(threads: int) -> None:
    """Leave the rank as a new process would be: no process group, no parallel state, no
    patches, the default collective timeout."""
    import torch
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        # a class-level tensor Megatron makes on first use: made under inference_mode by one
        # call, it would refuse the next call's training
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
    except Exception:  # noqa: BLE001 - a broken state ends the set below
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
    from anyspeed import adaptor
    from anyspeed.distributed.groups import DEFAULT_TIMEOUT_MINUTES, set_timeout

    adaptor.undo()
    set_timeout(DEFAULT_TIMEOUT_MINUTES)
    torch.set_num_threads(threads)


def _serve(
    rank: int,
    world: int,
    inbox: Any,
    q: Any,
    env: dict[str, str],
    threads: int,
    whole: dict[str, str] | None,
) -> None:
    """One shared rank: run each task sent to it until it is told to stop (None)."""
    os.setpgrp()  # the parent ends this rank and what it started in one killpg
    forkserver.adopt(whole)
    record_faults()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
    )
    base = dict(os.environ)
    keep_megatron_jit_off(unless_cuda=True)  # a task's module may import Megatron-Core
    import torch

    torch.set_num_threads(threads)
    while (task := _next(inbox, multiprocessing.parent_process())) is not None:
        try:
            # unpickled here, so a function this rank cannot import is reported, not fatal
            fn, kwargs, port = ForkingPickler.loads(task)
            os.environ.clear()
            os.environ.update(base, MASTER_PORT=str(port))
            argv = kwargs.pop("_argv", [])
            sys.argv = [sys.argv[0], *argv]
            from anyspeed import adaptor

            adaptor.apply(argv=argv)
            q.put((rank, True, pickle.dumps(fn(**kwargs))))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            q.put((rank, False, traceback.format_exc()))
        finally:
            _reset(threads)


def _next(inbox: Any, caller: Any) -> Any:
    """The next task, or None (stop) once the test process that started this rank is gone (a
    pytest-xdist worker ends without running atexit hooks). ``caller`` is multiprocessing's handle
    on it: a forked rank's parent process is the fork server, which outlives the caller while
    its ranks hold the server's liveness pipe, so the parent's pid would never change."""
    while True:
        try:
            return inbox.get(timeout=5)
        except queue.Empty:
            if caller is None or not caller.is_alive():
                return None


class Pool:
    """One world size's shared ranks."""

    def __init__(self, world: int, env: dict[str, str], threads: int) -> None:
        ctx, whole = forkserver.context(env)
        self.q = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(r, world, self.inboxes[r], self.q, dict(env), threads, whole),
                daemon=False,
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def submit(self, fn: Callable[..., Any], kwargs: dict[str, Any], port: int) -> None:
        """Send the task to every rank, pickled here: a task that cannot be pickled raises in
        the caller (a queue's feeder thread would only print the error, and the caller would
        wait for results until its timeout). Pickled once per rank, as a queue does: a tensor
        passed by file descriptor can be received once."""
        for box in self.inboxes:
            box.put(bytes(ForkingPickler.dumps((fn, dict(kwargs), port))))

    def close(self, kill: bool) -> None:
        """Stop the ranks (at once with ``kill``, else after their current task)."""
        if not kill:
            for box in self.inboxes:
                box.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.join(timeout=5)
            crash_report(p.pid)  # the rank's crash file, read already or unused


_POOLS: dict[tuple, Pool] = {}


def pool(world: int, env: dict[str, str], threads: int) -> Pool:
    """The live shared ranks for ``world`` and ``env`` (new ones when there are none)."""
    key = (world, tuple(sorted(env.items())), threads)
    p = _POOLS.get(key)
    if p is not None and not p.alive():
        discard(p)
        p = None
    if p is None:
        for other in [k for k in _POOLS if k[0] == world]:  # one set per world size
            _POOLS.pop(other).close(kill=False)
        p = _POOLS[key] = Pool(world, env, threads)
    return p


def discard(p: Pool) -> None:
    """End a set whose task failed or timed out (its ranks may be stuck in a collective)."""
    for k in [k for k, v in _POOLS.items() if v is p]:
        del _POOLS[k]
    p.close(kill=True)


@atexit.register
def close_all() -> None:
    """Stop every shared rank (the end of a test session)."""
    for p in list(_POOLS.values()):
        p.close(kill=False)
    _POOLS.clear()
