"""Activation swap: tensors a layer's modules save for backward wait in pinned host memory.

While a swapped module runs forward, autograd's saved tensors (not parameters, not tiny ones)
are copied to pinned host buffers on a side stream and the device copy is dropped; in backward
the first unpack of a layer's tensors brings them back and starts the copy of the layer before
it (prefetch), so the transfers overlap the backward of the layer in between. Needs a device
with pinned host memory and streams (CUDA / torch.accelerator); on the CPU the device memory
*is* host memory and the feature is a no-op (see :class:`~.feature.SwapAttention`).
"""

from __future__ import annotations

import torch

MIN_BYTES = 1 << 16  # smaller saved tensors stay on the device: the copy would cost more


class _Swapped:
    """One saved tensor in host memory, with the event after which the host copy is valid."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event, device: torch.device):
        self.host, self.event, self.device = host, event, device
        self.back: torch.Tensor | None = None  # the prefetched device copy

    def fetch(self, stream: torch.cuda.Stream) -> None:
        if self.back is None:
            with torch.cuda.stream(stream):
                stream.wait_event(self.event)
                self.back = self.host.to(self.device, non_blocking=True)


class LayerSwap:
    """The swap of one transformer layer's selected modules (``index``: its forward order)."""

    def __init__(self, swapper: Swapper, index: int, module: torch.nn.Module) -> None:
        self.swapper, self.index, self.module = swapper, index, module
        self.params: set[int] | None = None  # parameter storages, read at the first pack
        self.saved: list[_Swapped] = []

    def pack(self, t: torch.Tensor):
        if self.params is None:  # after DDP moved the parameters into its buffers
            self.params = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        if (
            not t.is_cuda
            or t.untyped_storage().data_ptr() in self.params
            or t.numel() * t.element_size() < MIN_BYTES
        ):
            return t
        s = self.swapper
        s.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s.stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(s.stream)
        t.record_stream(s.stream)  # the device copy may be freed once the D2H copy is done
        item = _Swapped(host, event, t.device)
        self.saved.append(item)
        return item

    def unpack(self, item):
        if not isinstance(item, _Swapped):
            return item
        s = self.swapper
        item.fetch(s.stream)
        s.prefetch(self.index - 1)
        torch.cuda.current_stream().wait_stream(s.stream)
        out, item.back = item.back, None
        out.record_stream(torch.cuda.current_stream())  # allocated on the side stream
        if item in self.saved:
            self.saved.remove(item)
        return out

    def prefetch(self) -> None:
        for item in self.saved:
            item.fetch(self.swapper.stream)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class Swapper:
    """The swapped layers of a process, in forward order (prefetch goes to the layer before)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()
        self.layers: list[LayerSwap] = []

    def add(self, module: torch.nn.Module) -> LayerSwap:
        layer = LayerSwap(self, len(self.layers), module)
        self.layers.append(layer)
        return layer

    def prefetch(self, index: int) -> None:
        if 0 <= index < len(self.layers):
            self.layers[index].prefetch()


def wrap_module_forward(module: torch.nn.Module, layer: LayerSwap) -> None:
    """Run ``module``'s forward under ``layer``'s saved-tensor hooks."""
    forward = module.forward

    def swapped_forward(*args, **kwargs):
        with layer.hooks():
            return forward(*args, **kwargs)

    module.forward = swapped_forward
