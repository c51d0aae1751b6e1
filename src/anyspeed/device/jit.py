"""Megatron-Core's ``jit_fuser`` left undone where there is no CUDA device.

``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and a dozen fused bias/activation
functions are decorated with it while ``megatron.core`` imports: each decoration imports
TorchDynamo and Inductor. That costs about 1.3 s of every process's 3.3 s of imports on a CPU
(measured: ``import anyspeed.megatron_adaptor`` 3.1-3.3 s against 1.9-2.0 s), and on a device
without CUDA nothing calls those functions (anyspeed switches Megatron's CUDA fusions off, and
Inductor does not run under the CPU device shim). So before ``megatron.core`` is imported on
such a device, the module is made to keep its own no-op decorator instead (Megatron's
``disable_jit_fuser``); on CUDA nothing changes.

The adaptor does this when it is applied. Entry points that may import Megatron-Core before
(``anyspeed``'s commands check their data with Megatron's code; spawned ranks unpickle a
function whose module imports it) install the finder first with ``unless_cuda``: the device is
looked at only when ``megatron.core.jit`` runs, so they need not import torch for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

_MODULE = "megatron.core.jit"


class _AfterJit(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as usual and runs its ``disable_jit_fuser`` right after the
    module has run, before anything imports ``jit_fuser`` from it (with ``unless_cuda``, not
    when the process's device is CUDA)."""

    def __init__(self, unless_cuda: bool = False) -> None:
        self.unless_cuda = unless_cuda

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        _remove()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run, unless_cuda = spec.loader.exec_module, self.unless_cuda

        def exec_module(module: ModuleType) -> None:
            run(module)
            disable = getattr(module, "disable_jit_fuser", None)
            if disable is not None and not (unless_cuda and _cuda()):
                disable()  # (a Megatron without it keeps its fuser)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterJit)]


def _cuda() -> bool:
    from anyspeed.device import detect

    return detect().is_cuda


def keep_megatron_jit_off(unless_cuda: bool = False) -> bool:
    """Make Megatron-Core's ``jit_fuser`` a no-op when it imports (the caller knows the device
    has no CUDA; with ``unless_cuda`` the device is detected then); False when
    ``megatron.core`` was already imported (its functions are decorated)."""
    if _MODULE in sys.modules:
        return False
    found = [f for f in sys.meta_path if isinstance(f, _AfterJit)]
    if found:
        found[0].unless_cuda = found[0].unless_cuda and unless_cuda  # the caller knows better
    else:
        sys.meta_path.insert(0, _AfterJit(unless_cuda))
    return True
