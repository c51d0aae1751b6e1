"""Where a spawned rank that crashes (SIGSEGV, SIGABRT) writes its Python stacks, so the
parent can say where it died: a peer's 'connection closed' error says only that it did."""

from __future__ import annotations

import os
import tempfile
from typing import Any


def fault_path(pid: int) -> str:
    """Where rank ``pid`` writes the Python stacks of a crash (SIGSEGV, SIGABRT)."""
    return os.path.join(tempfile.gettempdir(), f"anyspeed-rank-{pid}.fault")


def record_faults() -> Any:
    """Dump every thread's Python stack to :func:`fault_path` if this process crashes, so a
    rank that dies without reporting still says where; the caller keeps the file open."""
    import faulthandler

    out = open(fault_path(os.getpid()), "w")  # noqa: SIM115 - open for the process's life
    faulthandler.enable(file=out, all_threads=True)
    return out


def crash_report(pid: int | None) -> str:
    """The stacks rank ``pid`` dumped when it crashed ('' if none), the file then removed."""
    if pid is None:
        return ""
    try:
        with open(fault_path(pid)) as f:
            text = f.read().strip()
        os.remove(fault_path(pid))
    except OSError:
        return ""
    return text
