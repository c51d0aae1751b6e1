"""The saved-activation bytes meter: what autograd keeps for backward, per rank.

A ``saved_tensors_hooks`` pack hook records the storage of every tensor autograd saves while
a forward runs; the meter sums ``nbytes()`` over the *unique* storages when the forward ends.
Storages that recompute discarded (``CheckpointWithoutOutput`` resizes them to zero) count
zero, parameters count nothing (they are not activations), and a storage saved by several
nodes counts once. The figure is exact and deterministic, so tests can assert on it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedBytes:
    """Context manager: the bytes autograd saves for backward inside it (``.bytes`` on exit).

    ``exclude``: tensors whose storages never count (the model's parameters)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        # a DTensor (an FSDP2 shard) has no storage of its own: its local shard does
        local = (t.to_local() if hasattr(t, "to_local") else t for t in exclude)
        self._skip = {t.untyped_storage().data_ptr() for t in local}
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._skip:
            self._storages.setdefault(storage._cdata, storage)  # one entry per storage
        return t

    def measure(self) -> int:
        """Bytes now held by the recorded storages (a discarded storage has size 0)."""
        return sum(s.nbytes() for s in self._storages.values())

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None
        self.bytes = self.measure()
        self._storages.clear()


class FirstForwardMeter:
    """Measures the first forward of each module in ``modules`` (one micro-batch per model
    chunk) and then removes itself; ``bytes`` is the sum over the chunks, ``done`` when all
    were measured."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self.modules = list(modules)
        self.per_module: list[int | None] = [None] * len(self.modules)
        params = [p for m in self.modules for p in m.parameters()]
        self._handles = []
        for i, module in enumerate(self.modules):
            meter = SavedBytes(exclude=params)
            self._handles.append(module.register_forward_pre_hook(self._enter(meter)))
            self._handles.append(module.register_forward_hook(self._exit(meter, i)))

    def _enter(self, meter: SavedBytes):
        def hook(module, args):
            if meter._hooks is None and self.per_module[self.modules.index(module)] is None:
                meter.__enter__()

        return hook

    def _exit(self, meter: SavedBytes, i: int):
        def hook(module, args, output):
            if meter._hooks is None or self.per_module[i] is not None:
                return
            meter.__exit__(None, None, None)
            self.per_module[i] = meter.bytes
            if self.done:
                self.remove()

        return hook

    @property
    def done(self) -> bool:
        return all(b is not None for b in self.per_module)

    @property
    def bytes(self) -> int:
        return sum(b or 0 for b in self.per_module)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
