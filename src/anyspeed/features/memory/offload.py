"""Optimizer offload (``--swap-optimizer``, ``--optimizer-cpu-offload``): between steps the
optimizer's states and fp32 main parameters wait in host memory.

Around each ``optimizer.step()`` of a Megatron optimizer (single, chained, distributed), the
Adam moments and the fp32 copies of 16-bit parameters are copied to the device, the step
runs there unchanged (gradient copy, clipping, update, copy back to the model), and they are
copied back to host buffers allocated once (pinned when the device has pinned memory) while
their device memory returns to the allocator. The fp32 main gradients, rebuilt from the DDP
buffer at every step, are dropped after it. The step itself is the same code on the same
device, so losses are bit-equal with and without the offload.

Megatron-Core 0.16.1's own ``--optimizer-cpu-offload`` (``HybridDeviceOptimizer``) runs the
update on the host, is written against CUDA streams and needs Transformer Engine's
precision-aware optimizer, so anyspeed does not pass through to it. The devices are
parameters: a CPU test runs the copies with "device" and "host" both the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(opt) -> Iterator[torch.Tensor]:
    """The fp32 copies of 16-bit parameters a Megatron optimizer steps on (not the fp32
    parameters it updates in place: those are the model's weights)."""
    for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
        for group in getattr(opt, name, None) or []:
            yield from group


class OptimizerOffload:
    """Keeps ``optimizer``'s states and main parameters on ``host`` between steps, on
    ``device`` during them (``pin``: pinned host buffers; default: when ``device`` is not
    the CPU)."""

    def __init__(
        self,
        optimizer,
        device: str | torch.device,
        host: str | torch.device = "cpu",
        pin: bool | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.device, self.host = torch.device(device), torch.device(host)
        self.pin = (self.device.type != "cpu" if pin is None else pin) and _pinnable()
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (t, host)
        self._at_host: set[int] = set()  # ids of the tensors now in their host buffers
        self.copies = 0  # tensors moved, both ways (tests read it)
        self.offloaded_bytes = 0  # host bytes held between steps
        step = optimizer.step

        @functools.wraps(step)
        def offloaded_step(*args, **kwargs):
            self.to_device()
            try:
                return step(*args, **kwargs)
            finally:
                self.to_host()

        optimizer.step = offloaded_step
        self.to_host()  # the main parameters exist from the start; states after a step

    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensors that move: optimizer states (not scalars such as Adam's step count)
        and fp32 main parameters."""
        for opt in _inner_optimizers(self.optimizer):
            inner = getattr(opt, "optimizer", None)  # None on a rank without parameters
            for state in inner.state.values() if inner is not None else []:
                yield from (v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
            yield from _main_params(opt)

    def _host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        kept = self._buffers.get(id(t))
        if kept is None or kept[0] is not t:
            buf = torch.empty(t.shape, dtype=t.dtype, device=self.host, pin_memory=self.pin)
            kept = self._buffers[id(t)] = (t, buf)
        return kept[1]

    def to_host(self) -> None:
        """Copy every moving tensor to its host buffer and release its device memory."""
        moved = [t for t in self.tensors() if t.device.type == self.device.type]
        moved = [t for t in moved if id(t) not in self._at_host]
        for t in moved:
            buf = self._host_buffer(t)
            buf.copy_(t.data, non_blocking=True)
            t.data = buf
            if t.grad is not None:
                t.grad = None  # the fp32 main gradient: rebuilt from the DDP buffer each step
        self.copies += len(moved)
        self._at_host |= {id(t) for t in moved}
        self.offloaded_bytes = sum(b.nbytes for _, b in self._buffers.values())
        if moved and self.device.type != "cpu":
            torch.accelerator.synchronize()  # host buffers valid before anyone reads them

    def to_device(self) -> None:
        """Copy every offloaded tensor back to a fresh device tensor for the step."""
        for t, buf in self._buffers.values():
            if id(t) in self._at_host:
                dev = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                dev.copy_(buf, non_blocking=True)
                t.data = dev
                self.copies += 1
        self._at_host = set()


def _pinnable() -> bool:
    """Whether this build has an accelerator to pin host memory for."""
    acc = getattr(torch, "accelerator", None)
    return bool(acc is not None and acc.is_available())
