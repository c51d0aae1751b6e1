"""Megatron's persistent checkpoint worker runs on this device too.

Megatron-Core's asynchronous save (Megatron-LM's ``--async-save``, which it allows only with
``--use-persistent-ckpt-worker``) hands each save to ``PersistentAsyncCaller.async_loop`` in a
process started with multiprocessing's *spawn*: a fresh interpreter that never ran the one line.
Its first statement, ``torch.cuda.set_device(rank % torch.cuda.device_count())``, divides by
zero where torch has no CUDA; the worker dies and the trainer waits on its queue forever.

The loop is started as :func:`worker_loop` instead -- a module-level function, so the spawned
child finds it by name -- which installs the device layer in the child (``device-compat``'s
redirections: ``torch.cuda`` is this device; the worker only stages tensors to host memory and
writes files) and then runs Megatron's own loop unchanged.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

TARGET = "megatron.core.dist_checkpointing.strategies.async_utils.PersistentAsyncCaller.async_loop"
# Megatron's loop, held in a dict: the patch manager rebinds module-level copies of a patched
# object (``from x import f``), which would turn a bare global into worker_loop itself.
_MEGATRON: dict[str, Any] = {}


def worker_loop(*args: Any, **kwargs: Any) -> Any:
    """Megatron's worker loop; in a spawned child (where nothing of anyspeed ran and this
    module is fresh), after installing the device layer."""
    loop = _MEGATRON.get("loop")
    if loop is None:
        loop = _device_layer_in_child()
    return loop(*args, **kwargs)


def _device_layer_in_child() -> Callable[..., Any]:
    """Install ``device-compat``'s patches in this process; Megatron's loop (the class still
    holds it: no other patch is applied here)."""
    from megatron.core.dist_checkpointing.strategies import async_utils

    from anyspeed.device import detect
    from anyspeed.features.compat.device_compat import DeviceCompat
    from anyspeed.patching import PatchManager

    loop = vars(async_utils.PersistentAsyncCaller)["async_loop"].__func__
    manager = PatchManager()
    DeviceCompat().register_patches(manager, argparse.Namespace(), detect())
    manager.apply()
    _MEGATRON.update(loop=loop, manager=manager)
    return loop


def spawned_with_anyspeed(previous: Callable[..., Any]) -> staticmethod:
    """The patch: remember Megatron's loop (``previous``), start :func:`worker_loop` instead."""
    _MEGATRON["loop"] = previous
    return staticmethod(worker_loop)
