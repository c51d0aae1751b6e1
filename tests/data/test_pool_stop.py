"""Stopping a preprocessing pool never hangs: a worker that missed the pool's SIGTERM (here
one that ignores it, as a worker does whose pending SIGTERM was dropped when its handler was
reset) is killed after the grace period instead of being joined forever."""

from __future__ import annotations

import signal
import time

import pytest

from anyspeed.data.workers import mp_context, stop_pool


def _deaf() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@pytest.mark.parametrize(("deaf", "exitcode"), [(True, -signal.SIGKILL), (False, -signal.SIGTERM)])
def test_busy_workers_stop_and_deaf_ones_are_killed(deaf: bool, exitcode: int) -> None:
    pool = mp_context().Pool(2, initializer=_deaf if deaf else None)
    for _ in range(2):
        pool.apply_async(time.sleep, (60,))
    time.sleep(0.5)  # both workers are inside their task
    workers = list(pool._pool)
    start = time.monotonic()
    stop_pool(pool, grace_s=0.5)
    assert time.monotonic() - start < 10
    assert [w.exitcode for w in workers] == [exitcode, exitcode]
