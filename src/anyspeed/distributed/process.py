"""Who this process is in the job, printing once per job, and agreeing on an error."""

from __future__ import annotations

import os
from typing import Any


def world_size() -> int:
    """The job's world size from the launcher's environment (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def planned_world_size(nproc_per_node: int | None) -> int:
    """The job's world size while its flags are checked: the launcher's under one, else the
    ``--nproc-per-node`` processes anyspeed's own launcher is about to start."""
    return int(os.environ.get("WORLD_SIZE", nproc_per_node or 1))


def rank() -> int:
    """This process's global rank from the launcher's environment (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def is_rank0() -> bool:
    """Whether this process is global rank 0 (the one that prints and writes)."""
    return rank() == 0


def print0(*parts: Any, **kwargs: Any) -> None:
    """Print on global rank 0 only (flushed: the launcher interleaves the ranks' output)."""
    if is_rank0():
        print(*parts, **kwargs, flush=True)


def agree(error: str | None) -> str | None:
    """The first error any rank had (in rank order), on every rank: all raise or none does."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)
