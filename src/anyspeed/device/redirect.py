"""Central redirections that let CUDA-only code run on another device.

Three groups, each registered on a PatchManager under the owning feature's name:

* the ``torch.cuda`` surface (device index, streams/events, RNG, memory stats, nvtx, ...) is
  pointed at the device's own module (``torch.npu``, ``torch.xpu``) or, on the CPU, at
  :mod:`anyspeed.device.cpu_cuda`;
* literal CUDA device arguments (``device="cuda"``, ``device=torch.cuda.current_device()``,
  ``.cuda()``, ``.to("cuda:0")``) in tensor factories and moves are mapped to the device;
* process groups asked for with ``nccl`` get the device's backend: see
  :mod:`anyspeed.device.process_groups`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from anyspeed.device import DeviceInfo
from anyspeed.patching import PatchManager

# Names of the torch.cuda surface that Megatron-Core and Megatron-LM touch.
CUDA_SURFACE = (
    "current_device",
    "set_device",
    "device_count",
    "is_initialized",
    "_lazy_init",
    "_lazy_call",
    "device",
    "device_of",
    "default_generators",
    "get_rng_state",
    "set_rng_state",
    "get_rng_state_all",
    "set_rng_state_all",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
    "initial_seed",
    "Stream",
    "Event",
    "current_stream",
    "default_stream",
    "set_stream",
    "stream",
    "synchronize",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
    "memory_stats",
    "memory_summary",
    "mem_get_info",
    "empty_cache",
    "ipc_collect",
    "get_device_name",
    "get_device_capability",
    "get_device_properties",
    "is_bf16_supported",
    "get_arch_list",
)
# torch.cuda.random re-exports the RNG functions; Megatron calls them through that module.
_RANDOM_SURFACE = ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "seed")
_NVTX = ("range_push", "range_pop", "mark", "range")


def _impl_module(info: DeviceInfo) -> Any:
    if info.is_cpu:
        from anyspeed.device import cpu_cuda

        return cpu_cuda
    return getattr(torch, info.type)


def register_cuda_surface(pm: PatchManager, info: DeviceInfo, feature: str) -> None:
    """Point every ``torch.cuda`` name Megatron uses at the device's implementation."""
    from anyspeed.device import cpu_cuda

    impl = _impl_module(info)
    why = f"torch.cuda has no device on this machine; route to the {info.type} implementation"
    for name in CUDA_SURFACE:
        new = getattr(impl, name, None)
        if new is None:
            new = getattr(cpu_cuda, name)  # backend lacks it: CPU semantics are the safe default
        pm.register_replace(f"torch.cuda.{name}", new, feature=feature, reason=why, create=True)
    for name in _RANDOM_SURFACE:
        pm.register_replace(
            f"torch.cuda.random.{name}",
            getattr(impl, name, getattr(cpu_cuda, name)),
            feature=feature,
            reason=why,
        )
    if info.is_cpu:
        _register_host_rng(pm, feature)
    for name in _NVTX:
        pm.register_replace(
            f"torch.cuda.nvtx.{name}",
            getattr(cpu_cuda.nvtx, name),
            feature=feature,
            reason="NVTX ranges are CUDA profiler markers: no-ops elsewhere",
        )


def _register_host_rng(pm: PatchManager, feature: str) -> None:
    """Keep host-side RNG draws off the CPU generator that plays the device RNG.

    On CUDA a DataLoader draws its base seed from the host generator, leaving the device
    generator (dropout) untouched. On the CPU both are one generator, so a DataLoader created
    after a checkpoint's RNG state was restored would shift every later dropout mask and a
    resumed run would diverge from the uninterrupted one. A DataLoader without a generator gets
    its own, seeded from the run's seed.
    """
    from torch.utils.data import DataLoader

    sig = inspect.signature(DataLoader.__init__)

    def wrap_init(init):
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            bound = sig.bind_partial(self, *args, **kwargs)
            if bound.arguments.get("generator") is None:
                kwargs["generator"] = torch.Generator().manual_seed(torch.initial_seed())
            init(self, *args, **kwargs)

        return __init__

    pm.register_wrap(
        "torch.utils.data.DataLoader.__init__",
        wrap_init,
        feature=feature,
        reason="the device RNG is the CPU generator: DataLoader seed draws use their own "
        "generator so resumed runs reproduce dropout exactly",
    )


# ---------------------------------------------------------------------------- device arguments
def make_mapper(info: DeviceInfo) -> Callable[[Any], Any]:
    """A function mapping CUDA device arguments (str, int, torch.device) to this device."""
    impl = _impl_module(info)

    def target(index: int | None) -> torch.device:
        if info.is_cpu:
            return torch.device("cpu")
        return torch.device(info.type, impl.current_device() if index is None else index)

    def map_device(dev: Any) -> Any:
        if dev is None or isinstance(dev, bool):
            return dev
        if isinstance(dev, int):
            return target(dev)
        if isinstance(dev, str):
            if dev == "cuda" or dev.startswith("cuda:"):
                return target(int(dev[5:]) if ":" in dev else None)
            return dev
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return target(dev.index)
        return dev

    return map_device


# Factories whose ``device=`` keyword may name CUDA.
_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "rand",
    "randn",
    "randint",
    "randperm",
    "arange",
    "range",
    "linspace",
    "logspace",
    "eye",
    "tensor",
    "as_tensor",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "empty_strided",
    "tril_indices",
    "triu_indices",
    "scalar_tensor",
    "asarray",
)
_NEW_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided")


def register_device_args(pm: PatchManager, info: DeviceInfo, feature: str) -> None:
    """Map CUDA device arguments to the device in factories, ``.to``, ``.cuda`` and pinning."""
    map_device = make_mapper(info)
    cpu = info.is_cpu
    why = "literal CUDA device arguments in Megatron must land on this device"
    # ``with torch.device(...)`` recognises factories by identity through a cached set built on
    # first use: build it now, from the original functions, or the wrappers below would make
    # the context ignore them (meta-device init, transformers' from_pretrained).
    from torch.utils._device import _device_constructors

    _device_constructors()

    def fix_kwargs(kwargs: dict) -> dict:
        if "device" in kwargs:
            kwargs["device"] = map_device(kwargs["device"])
        if cpu and kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # no pinned-memory allocator without an accelerator
        return kwargs

    def factory_wrapper(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            return fn(*args, **fix_kwargs(kwargs))

        return wrapped

    for name in _FACTORIES:
        if hasattr(torch, name):
            pm.register_wrap(f"torch.{name}", factory_wrapper, feature=feature, reason=why)
    for name in _NEW_METHODS:
        pm.register_wrap(f"torch.Tensor.{name}", factory_wrapper, feature=feature, reason=why)

    def to_wrapper(fn):
        @functools.wraps(fn)
        def to(self, *args, **kwargs):
            if (
                args
                and isinstance(args[0], (str, int, torch.device))
                and not isinstance(args[0], bool)
            ):
                args = (map_device(args[0]), *args[1:])
            return fn(self, *args, **fix_kwargs(kwargs))

        return to

    pm.register_wrap("torch.Tensor.to", to_wrapper, feature=feature, reason=why)
    pm.register_wrap("torch.nn.Module.to", to_wrapper, feature=feature, reason=why)

    def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self.to(
            map_device(device if device is not None else "cuda"),
            non_blocking=non_blocking,
            memory_format=memory_format,
        )

    def module_cuda(self, device=None):
        return self.to(map_device(device if device is not None else "cuda"))

    _register_megatron_allocations(pm, info, map_device, feature, why)
    _register_legacy_type_names(pm, info, feature)
    pm.register_replace("torch.Tensor.cuda", tensor_cuda, feature=feature, reason=why)
    pm.register_replace("torch.nn.Module.cuda", module_cuda, feature=feature, reason=why)
    if cpu:
        pm.register_replace(
            "torch.Tensor.pin_memory",
            lambda self, device=None: self,
            feature=feature,
            reason="no pinned memory without an accelerator: pinning is the identity",
        )


def _register_megatron_allocations(
    pm: PatchManager, info: DeviceInfo, map_device: Callable, feature: str, why: str
) -> None:
    """CUDA named where the factory wrappers cannot see it: a checkpoint tensor's ``init_data``
    (its ``init_fn`` is the ``torch.empty`` bound at import) and torch's ``DeviceMesh``."""

    def init_data_wrapper(fn):
        @functools.wraps(fn)
        def init_data(self, device, init_fn=None):
            # its default init_fn is the torch.empty bound when Megatron was imported
            return fn(self, map_device(device), *(() if init_fn is None else (init_fn,)))

        return init_data

    pm.register_wrap(
        "megatron.core.dist_checkpointing.mapping.ShardedTensor.init_data",
        init_data_wrapper,
        feature=feature,
        reason=why + " (a checkpoint exchange allocates with init_data('cuda'))",
    )
    from torch.distributed.device_mesh import DeviceMesh

    from_group = DeviceMesh.from_group

    def mesh_from_group(group, device_type, *args, **kwargs):
        if device_type == "cuda" or str(device_type).startswith("cuda:"):
            device_type = info.type
        return from_group(group, device_type, *args, **kwargs)

    pm.register_replace(
        "torch.distributed.device_mesh.DeviceMesh.from_group",
        staticmethod(functools.wraps(from_group)(mesh_from_group)),
        feature=feature,
        reason=why + " (Megatron's torch-FSDP2 wrapper makes a 'cuda' device mesh)",
    )


def _register_legacy_type_names(pm: PatchManager, info: DeviceInfo, feature: str) -> None:
    """``Tensor.type()`` names this device's tensors ``torch.cuda.*`` (and accepts those names)."""
    cpu = info.is_cpu
    dev_prefix = "torch." if cpu else f"torch.{info.type}."

    def type_wrapper(fn):
        @functools.wraps(fn)
        def type_(self, dtype=None, non_blocking=False, **kwargs):
            if dtype is None and not kwargs:
                # Megatron's optimizer compares against 'torch.cuda.FloatTensor' and friends:
                # name this device's tensors the way CUDA code expects.
                name = fn(self)
                if self.device.type == ("cpu" if cpu else info.type):
                    return "torch.cuda." + name.removeprefix(dev_prefix)
                return name
            if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
                dtype = dev_prefix + dtype.removeprefix("torch.cuda.")
            return fn(self, dtype, non_blocking, **kwargs)

        return type_

    pm.register_wrap(
        "torch.Tensor.type",
        type_wrapper,
        feature=feature,
        reason="legacy type names: this device's tensors answer 'torch.cuda.*'",
    )
