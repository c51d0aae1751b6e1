"""Pool workers that end with their parent and leave no files behind.

A live parent handles Ctrl-C and SIGTERM itself: it terminates the pool (SIGTERM kills a
worker at once) and deletes what the workers wrote. A parent that dies (even by SIGKILL,
which it cannot act on) is noticed by a watchdog thread in each worker: the worker deletes the
run's partial datasets (``<out>.part*.tmp-<parent>*``) and exits.
"""

from __future__ import annotations

import _thread
import glob
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

_WATCH_SECONDS = 0.2
_STATE: dict[str, Any] = {"parent": None, "outputs": []}


def mp_context() -> Any:
    """Fork where available (workers start fast), spawn elsewhere."""
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


def stop_pool(pool: Any, grace_s: float = 5.0) -> None:
    """Terminate ``pool`` and wait for it, never forever. A SIGTERM that reaches a new worker
    before :func:`init_worker` runs trips the parent's inherited Python handler, and resetting
    the handler then drops the pending signal: the worker lives on, waiting on a task queue the
    terminating pool holds locked, and ``Pool.terminate`` joins it forever (a test hung so).
    Workers alive after ``grace_s`` get SIGKILL (they write only temp files the parent
    removes)."""
    stopper = threading.Thread(target=pool.terminate, daemon=True)
    stopper.start()
    stopper.join(grace_s)
    while stopper.is_alive():
        for proc in list(getattr(pool, "_pool", ())):
            if proc.exitcode is None:
                proc.kill()
        stopper.join(1.0)
    pool.join()


def init_worker(parent: int, outputs: list[str] | None = None) -> None:
    """Pool initializer: signal handling plus the parent watchdog.

    ``outputs`` are the run's final prefixes, whose partial datasets an orphaned worker
    deletes."""
    _STATE.update(parent=parent, outputs=list(outputs or []))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, _on_interrupt)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_SECONDS)
    # Run the clean-up in the main thread, between two of its steps, so that it cannot race
    # a file being created or renamed; a long tokenizer call is finished first.
    _thread.interrupt_main(signal.SIGINT)


def _on_interrupt(signum: int, frame: object) -> None:
    """Ctrl-C is the parent's to handle; from the watchdog it means the parent is gone."""
    parent = _STATE["parent"]
    if parent is None or os.getppid() == parent:
        return
    for out in _STATE["outputs"]:
        for path in glob.glob(f"{glob.escape(out)}.part*.tmp-{parent}*"):
            try:
                os.remove(path)
            except FileNotFoundError:  # another worker removed it first
                pass
    os._exit(1)
