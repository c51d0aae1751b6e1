"""Megatron-Core's ``jit_fuser`` left undone where there is no CUDA device.

``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and a dozen fused bias/activation
functions are decorated with it while ``megatron.core`` imports: each decoration imports
TorchDynamo and Inductor. That costs about 1.3 s of every process's 3.3 s of imports on a CPU
(measured: ``import anyspeed.megatron_adaptor`` 3.1-3.3 s against 1.9-2.0 s), and on a device
without CUDA nothing calls those functions (anyspeed switches Megatron's CUDA fusions off, and
Inductor does not run under the CPU device shim). So before ``megatron.core`` is imported on
such a device, the module is made to keep its own no-op decorator instead (Megatron's
``disable_jit_fuser``); on CUDA nothing changes.
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
    module has run, before anything imports ``jit_fuser`` from it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        _remove()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            disable = getattr(module, "disable_jit_fuser", None)
            if disable is not None:  # (a Megatron without it keeps its fuser)
                disable()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterJit)]


def keep_megatron_jit_off() -> bool:
    """Make Megatron-Core's ``jit_fuser`` a no-op when it imports (a device without CUDA);
    False when ``megatron.core`` was already imported (its functions are decorated)."""
    if _MODULE in sys.modules:
        return False
    if not any(isinstance(f, _AfterJit) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterJit())
    return True
