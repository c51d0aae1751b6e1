"""Test ranks forked from a server that has imported torch, Megatron-Core and anyspeed once.

A spawned rank spends seconds importing torch, Megatron-Core, transformers and anyspeed (about
3-4 s of CPU per rank on a 2-core VM) before it runs a test's function of a fraction of that. On a
CPU-only machine :func:`context` hands out multiprocessing's ``forkserver`` instead: its server
imports :mod:`anyspeed.testing.preload` once, without applying the adaptor, and every rank is a
fork of it. A forked rank must then look like a spawned one:

- its environment is the caller's at the time of the call (a fork server keeps its own, from
  when it started), which :func:`adopt` sets; where that environment differs from the server's
  in a variable that an import may read (anything but the few that only run-time code reads,
  ``_RUN_TIME``), the ranks are spawned as before;
- torch's and numpy's global random generators are seeded from the OS's entropy, as a new
  process's are (not left in the server's state, the same in every rank; the standard library's
  ``random`` reseeds itself after a fork).

A forked rank writes to the standard output and error the server was started with (under
pytest's capture, the first such test's); failures come back through the result queue, and a
crash's stacks through :mod:`anyspeed.testing.faults`, as before. ``ANYSPEED_TEST_FORKSERVER=0``
spawns every rank. Never used with CUDA or another accelerator:
a process that forks after touching one cannot use it.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import sys
from typing import Any

import torch.multiprocessing as mp

ENV = "ANYSPEED_TEST_FORKSERVER"
PRELOAD = "anyspeed.testing.preload"
# Variables that change in a test process as it runs and that only run-time code reads: pytest's
# per-test one, anyspeed's notice-shown mark, and the attention backend Megatron's language
# model sets from its flags when it is built (and checks there).
_RUN_TIME = {
    "PYTEST_CURRENT_TEST",
    "ANYSPEED_QUIET_NOTICE_SHOWN",
    "NVTE_FLASH_ATTN",
    "NVTE_FUSED_ATTN",
    "NVTE_UNFUSED_ATTN",
}
_server_env: dict[str, str] | None = None


def context(env: dict[str, str]) -> tuple[Any, dict[str, str] | None]:
    """The multiprocessing context for ranks that run with ``env`` added to this process's
    environment, and the whole environment a forked rank must adopt (None for spawned ranks)."""
    global _server_env
    wanted = {**os.environ, **env}
    if not usable():
        return mp.get_context("spawn"), None
    ctx = mp.get_context("forkserver")
    if _server_env is None:  # start the server now, with this process's environment
        ctx.set_forkserver_preload([PRELOAD])
        _server_env = dict(os.environ)
        multiprocessing.forkserver.ensure_running()
    if _differ(wanted, _server_env):
        return mp.get_context("spawn"), None
    return ctx, wanted


def adopt(env: dict[str, str] | None) -> None:
    """In a forked rank: take the caller's environment and start the global random generators
    afresh, as a spawned rank would (no-op for a spawned rank, ``env`` None)."""
    if env is None:
        return
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.seed()  # from the OS's entropy, as a new process's generator is seeded
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # the same for numpy's, on import


def usable() -> bool:
    """Whether ranks can be forked here: Linux, the CPU, and not switched off."""
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    import torch

    from anyspeed.device import detect

    return detect().is_cpu and not torch.cuda.is_available()


def _differ(a: dict[str, str], b: dict[str, str]) -> bool:
    keys = (a.keys() | b.keys()) - _RUN_TIME
    return any(a.get(k) != b.get(k) for k in keys)
