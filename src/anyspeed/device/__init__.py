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

__all__ = ["DeviceInfo", "detect", "forced_type", "torch_device"]

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


def forced_type() -> str:
    """``ANYSPEED_DEVICE`` ("" when unset); UsageError (one line) for a value that is not a
    device type torch knows, before anything is built on it."""
    from anyspeed.errors import UsageError

    forced = os.environ.get("ANYSPEED_DEVICE", "").strip().lower()
    if not forced:
        return ""
    try:
        ok = torch.device(forced).type == forced and ":" not in forced
    except RuntimeError:
        ok = False
    if not ok:
        raise UsageError(
            f"ANYSPEED_DEVICE={forced}: not a device type torch knows; use cpu, cuda or another "
            "torch device type without an index (cuda, not cuda:0), or unset it"
        )
    return forced


@functools.cache
def detect() -> DeviceInfo:
    """Detect the device. ``ANYSPEED_DEVICE=cpu`` (or another type) forces a choice."""
    forced = forced_type()
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
