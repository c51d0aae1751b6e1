"""Device layer: find the machine's device and make Megatron's CUDA-only code run on it.

``detect()`` picks CUDA, any ``torch.accelerator`` backend whose extension is installed (NPU, XPU,
...), else the CPU. :mod:`.redirect` and :mod:`.process_groups` hold, centrally, the redirections
that a non-CUDA device needs: the ``torch.cuda`` surface (:mod:`.cpu_cuda` on the CPU), literal
``"cuda"`` device arguments, and the process-group backend (``nccl`` -> the device's). The
``device-compat`` feature registers them; on CUDA it registers nothing.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

__all__ = ["DeviceInfo", "detect", "torch_device"]

# Default process-group backend per device type.
_DIST_BACKEND = {"cuda": "nccl", "cpu": "gloo", "npu": "hccl", "xpu": "xccl", "mps": "gloo"}


@dataclass(frozen=True)
class DeviceInfo:
    """What this process trains on."""

    type: str  # "cuda", "cpu", or a torch.accelerator type such as "npu" / "xpu"
    dist_backend: str
    name: str

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.type == "cpu"


def _dist_backend(dev_type: str) -> str:
    if dev_type in _DIST_BACKEND:
        return _DIST_BACKEND[dev_type]
    try:
        import torch.distributed as dist

        return dist.Backend.default_device_backend_map.get(dev_type, "gloo")
    except Exception:  # pragma: no cover - distributed not built
        return "gloo"


@functools.cache
def detect() -> DeviceInfo:
    """Detect the device. ``ANYSPEED_DEVICE=cpu`` (or another type) forces a choice."""
    forced = os.environ.get("ANYSPEED_DEVICE", "").strip().lower()
    if forced:
        dev_type = forced
    elif torch.cuda.is_available():
        dev_type = "cuda"
    else:
        dev_type = "cpu"
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            cur = acc.current_accelerator()
            if cur is not None:
                dev_type = cur.type
    if dev_type == "cuda":
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"
    elif dev_type == "cpu":
        from anyspeed.device import cpu_cuda

        name = cpu_cuda.get_device_name()
    else:
        mod = getattr(torch, dev_type, None)
        try:
            name = mod.get_device_name() if mod is not None else dev_type
        except Exception:
            name = dev_type
    return DeviceInfo(type=dev_type, dist_backend=_dist_backend(dev_type), name=name)


def torch_device(index: int | None = None) -> torch.device:
    """The ``torch.device`` this process computes on (index defaults to the current one)."""
    info = detect()
    if info.is_cpu:
        return torch.device("cpu")
    if index is None:
        mod = getattr(torch, info.type)
        index = mod.current_device()
    return torch.device(info.type, index)
