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


def start_state() -> dict:
    """What a rank starts with: how it was started, its environment, and the first draws of
    torch's and numpy's global generators."""
    import multiprocessing
    import os

    import numpy as np
    import torch
    from megatron.core.fusions import fused_bias_swiglu as swiglu

    return {
        "method": multiprocessing.get_start_method(),
        "env": dict(os.environ),
        "torch": torch.rand(4).tolist(),
        "numpy": np.random.rand(4).tolist(),
        # Megatron's fused functions stayed plain (torch.compile's wrapper has __wrapped__)
        "jit_off": not hasattr(swiglu.swiglu, "__wrapped__"),
    }


def pid() -> int:
    """This rank's process id."""
    import os

    return os.getpid()


def total(t) -> float:  # noqa: ANN001 - a tensor
    """The sum of a tensor passed as an argument."""
    return float(t.sum())
