"""Megatron's persistent checkpoint worker runs on this device too.

Megatron-Core's asynchronous save (Megatron-LM's ``--async-save``, which it allows only with
``--use-persistent-ckpt-worker``) hands each save to ``PersistentAsyncCaller.async_loop`` in a
process started with multiprocessing's *spawn*: a fresh interpreter that never ran the one line.
Its first statement, ``torch.cuda.set_device(rank % torch.cuda.device_count())``, divides by
zero where torch has no CUDA; the worker dies and the trainer waits on its queue forever.

The loop is started as :func:`worker_loop` instead -- a module-level function bound to an
installer, so the spawned child finds both by name -- which installs the device layer in the
child (``device-compat`` hands over its installer: ``torch.cuda`` is this device; the worker only
stages tensors to host memory and writes files) and then runs Megatron's own loop unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

TARGET = "megatron.core.dist_checkpointing.strategies.async_utils.PersistentAsyncCaller.async_loop"
# Megatron's loop, held in a dict: the patch manager rebinds module-level copies of a patched
# object (``from x import f``), which would turn a bare global into worker_loop itself.
_MEGATRON: dict[str, Any] = {}


def worker_loop(install: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
    """Megatron's worker loop; in a spawned child (where nothing of anyspeed ran and this
    module is fresh), after ``install()`` put the device layer in place."""
    loop = _MEGATRON.get("loop")
    if loop is None:
        from megatron.core.dist_checkpointing.strategies import async_utils

        loop = vars(async_utils.PersistentAsyncCaller)["async_loop"].__func__  # before patching
        _MEGATRON.update(loop=loop, manager=install())
    return loop(*args, **kwargs)


def spawned_with(install: Callable[[], Any]) -> Callable[[Callable[..., Any]], staticmethod]:
    """The patch: remember Megatron's loop, start :func:`worker_loop` (with ``install``, a
    module-level function that applies the device layer in this process) instead."""

    def wrap(previous: Callable[..., Any]) -> staticmethod:
        _MEGATRON["loop"] = previous
        return staticmethod(functools.partial(worker_loop, install))

    return wrap
