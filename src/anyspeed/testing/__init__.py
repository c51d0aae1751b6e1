"""Run a function on N local processes with a process group, a deadline and clear failures.

``run_distributed(fn, world_size, **kwargs)`` spawns ``world_size`` processes, each with the
torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), applies the anyspeed
adaptor, calls ``fn(**kwargs)`` and returns the per-rank results. A rank that raises fails the
call with that rank's traceback; a hung collective fails it when ``timeout`` expires (every rank
is killed), so a test never hangs CI.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import traceback
from collections.abc import Callable
from typing import Any

from anyspeed.launch import free_port
from anyspeed.testing import forkserver
from anyspeed.testing.faults import crash_report, record_faults

__all__ = ["run_distributed", "free_port", "DistributedError"]


class DistributedError(RuntimeError):
    """A rank failed or the group timed out."""


def _entry(fn, rank, world, port, q, kwargs, env, threads, whole):
    # Own process group: the parent can then end this rank *and* anything it started
    # (dist_checkpointing's writer/manager processes) in one killpg.
    os.setpgrp()
    forkserver.adopt(whole)
    faults = record_faults()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        import torch

        torch.set_num_threads(threads)
        import sys

        # This rank's command line, not the parent's (spawned children inherit the parent's
        # argv): the adaptor applies it, and a rank that imports the one-line shim reads it.
        argv = kwargs.pop("_argv", [])
        sys.argv = [sys.argv[0], *argv]
        from anyspeed import adaptor, quiet

        quiet.install()  # as anyspeed's own ranks are: no wall of Megatron's fallback notices
        adaptor.apply(argv=argv)
        result = fn(**kwargs)
        # Plain pickle (not torch's shared-memory reducer): the bytes outlive this process.
        q.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        import faulthandler

        faulthandler.disable()
        faults.close()
        os.remove(faults.name)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    argv: list[str] | None = None,
    fresh: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(**kwargs)`` on ``world_size`` processes; return results indexed by rank.

    ``fn`` must be importable by name (a module-level function). ``argv`` is the command line
    the adaptor sees in each process (feature flags). Threads are split across the ranks (and
    pytest-xdist's workers).
    Under ``ANYSPEED_SHARED_RANKS=1`` the ranks of earlier calls run it, unless ``fresh``
    (:mod:`anyspeed.testing.pool`).
    """
    from anyspeed.testing import pool as testing_pool

    port = free_port()
    # pytest-xdist runs several test processes at once: they share the cores too
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = max(1, (os.cpu_count() or 1) // (world_size * workers))
    kwargs = dict(kwargs, _argv=list(argv or []))
    if testing_pool.enabled() and not fresh:
        pool = testing_pool.pool(world_size, dict(env or {}), threads)
        pool.submit(fn, kwargs, port)
        try:
            return _collect(pool.q, pool.procs, world_size, timeout, fn.__name__)
        except BaseException:
            testing_pool.discard(pool)
            raise
    ctx, whole = forkserver.context(dict(env or {}))
    q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, q, dict(kwargs), dict(env or {}), threads, whole),
            daemon=False,  # ranks may start helper processes (checkpoint writers)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(q, procs, world_size, timeout, fn.__name__)
    finally:
        for p in procs:
            p.join(timeout=5)
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and its helper processes
            except (ProcessLookupError, PermissionError):
                pass
            p.join(timeout=5)
            crash_report(p.pid)  # a killed rank's crash file, unused


def _collect(q: Any, procs: list[Any], world_size: int, timeout: float, name: str) -> list[Any]:
    """Every rank's result from ``q``; DistributedError with the failing ranks' tracebacks, or
    when ``timeout`` passes (a hung collective) or a rank dies without reporting."""
    import time

    results: dict[int, Any] = {}
    failures: list[str] = []
    reported: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise DistributedError(
                    f"{name}: ranks {missing} did not finish within {timeout:.0f}s "
                    "(hung collective?)"
                )
            try:
                rank, ok, payload = q.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    i
                    for i, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and i not in reported
                ]
                if dead:
                    # A rank died without reporting (segfault, os._exit): give peers a moment.
                    deadline = min(deadline, time.monotonic() + 10)
                    reported.update(dead)
                    failures.extend(_death(i, procs[i]) for i in dead)
                continue
            reported.add(rank)
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures.append(f"rank {rank} failed:\n{payload}")
                # Peers of a failed rank usually block in a collective: stop waiting soon.
                deadline = min(deadline, time.monotonic() + 15)
        if failures:
            raise DistributedError("\n".join(failures))
    except DistributedError as exc:
        if failures and "did not finish" in str(exc):
            raise DistributedError("\n".join(failures)) from None
        raise
    return [results[r] for r in range(world_size)]


def _death(rank: int, proc: Any) -> str:
    """What a rank that died without reporting says: its exit code, or the signal and the
    Python stacks it dumped (a peer's 'connection closed' error says only that it died)."""
    code = proc.exitcode
    if code >= 0:
        return f"rank {rank} exited with code {code}"
    stacks = crash_report(proc.pid)
    return f"rank {rank} died of signal {-code}" + (f":\n{stacks}" if stacks else "")
