"""Rank functions that test :mod:`anyspeed.testing` itself."""

from __future__ import annotations

import ctypes

import torch.distributed as dist


def crash_in_named_frame(victim: int) -> int:
    """Rank ``victim`` dies of SIGSEGV inside this frame; the others wait on it in a barrier."""
    dist.init_process_group("gloo")
    if dist.get_rank() == victim:
        ctypes.string_at(0)  # reads address 0: a segmentation fault
    dist.barrier()
    return dist.get_rank()
