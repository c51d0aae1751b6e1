"""Starting local ranks: a free port, the torchrun command line, a world of one.

``anyspeed pretrain --nproc-per-node N`` starts its ranks through :func:`torchrun_command`, in
the environment :func:`torchrun_env` returns; a run without a launcher makes itself rank 0 of a
world of one with :func:`single_process_env`.
"""

from __future__ import annotations

import os
import socket
import sys


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, module: str, argv: list[str]) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N -m module argv...``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", module, *argv]  # fmt: skip


def torchrun_env(nproc: int) -> dict[str, str]:
    """This process's environment for the launcher, with ``OMP_NUM_THREADS=1`` when unset and
    ``nproc > 1``: torchrun's own default for its ranks, set here so it has no banner to print."""
    env = dict(os.environ)
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def single_process_env() -> dict[str, str]:
    """The launcher environment of rank 0 in a world of one (a fresh local port)."""
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
