"""Process groups asked for with ``nccl`` get the device's backend (gloo on the CPU).

NCCL-only options are dropped, and the ops gloo lacks (``ReduceOp.AVG``) are emulated with
identical numbers. Registered on a PatchManager under the owning feature's name.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from anyspeed.device import DeviceInfo
from anyspeed.device.redirect import make_mapper
from anyspeed.patching import PatchManager


def register_dist_backend(pm: PatchManager, info: DeviceInfo, feature: str) -> None:
    """``nccl`` process groups become the device's backend; gloo's missing ops are emulated."""

    backend = info.dist_backend

    def map_backend(b: Any) -> Any:
        if isinstance(b, str) and "nccl" in b:
            if ":" in b:  # e.g. "cpu:gloo,cuda:nccl"
                return backend
            return b.replace("nccl", backend)
        return b

    def map_options(b: Any, options: Any) -> Any:
        # NCCL's ProcessGroupNCCL.Options mean nothing to another backend.
        if options is not None and "NCCL" in type(options).__qualname__ and backend != "nccl":
            return None
        return options

    def map_device_id(dev: Any) -> Any:
        if info.is_cpu:
            return None  # gloo process groups are not bound to a device
        return make_mapper(info)(dev)

    def group_wrapper(fn):
        """Map backend / pg_options / device_id of init_process_group and new_group."""
        sig = inspect.signature(fn)
        is_init = fn.__name__ == "init_process_group"

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            bound = sig.bind_partial(*args, **kwargs)
            a = bound.arguments
            if is_init and a.get("backend") is None:
                a["backend"] = backend
            if "backend" in a:
                a["backend"] = map_backend(a["backend"])
            if "pg_options" in a:
                a["pg_options"] = map_options(a.get("backend"), a["pg_options"])
            if "device_id" in a:
                a["device_id"] = map_device_id(a["device_id"])
            return fn(*bound.args, **bound.kwargs)

        return wrapped

    def barrier_wrapper(fn):
        @functools.wraps(fn)
        def barrier(group=None, async_op=False, device_ids=None):
            if device_ids is not None and info.is_cpu:
                device_ids = None  # gloo barriers take no device
            return fn(group=group, async_op=async_op, device_ids=device_ids)

        return barrier

    why_pg = f"process groups asked for with nccl use {backend} on this device"
    for name in ("init_process_group", "new_group"):
        pm.register_wrap(f"torch.distributed.{name}", group_wrapper, feature=feature, reason=why_pg)
        # torch's own helpers (new_subgroups_by_enumeration, Megatron's HyperCommGrid through
        # it) call the module's function, not the package attribute.
        pm.register_wrap(
            f"torch.distributed.distributed_c10d.{name}",
            group_wrapper,
            feature=feature,
            reason=why_pg,
        )
    pm.register_wrap(
        "torch.distributed.barrier",
        barrier_wrapper,
        feature=feature,
        reason="gloo barriers take no device_ids",
    )
    if backend == "gloo":
        _register_gloo_avg(pm, feature)
        _register_gloo_uneven(pm, feature)


def _is_gloo(group: Any) -> bool:
    """Whether ``group`` (None: the default group) runs on gloo."""
    import torch.distributed as dist

    try:
        return dist.get_backend(group) == "gloo"
    except Exception:
        return False


class _DivideOnWait:
    """Async handle whose wait() finishes an emulated AVG by dividing the summed result."""

    def __init__(self, work: Any, tensor: torch.Tensor, size: int) -> None:
        self._work, self._tensor, self._size, self._done = work, tensor, size, False

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        out = self._work.wait(*args, **kwargs)
        if not self._done:
            self._tensor.div_(self._size)
            self._done = True
        return out

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _register_gloo_avg(pm: PatchManager, feature: str) -> None:
    import torch.distributed as dist

    avg = dist.ReduceOp.AVG

    def all_reduce_wrapper(fn):
        @functools.wraps(fn)
        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if op == avg and _is_gloo(group):
                n = dist.get_world_size(group)
                work = fn(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
                if async_op:
                    return _DivideOnWait(work, tensor, n)
                tensor.div_(n)
                return work
            return fn(tensor, op=op, group=group, async_op=async_op)

        return all_reduce

    def reduce_scatter_wrapper(fn):
        @functools.wraps(fn)
        def reduce_scatter_tensor(
            output,
            input,
            op=dist.ReduceOp.SUM,
            group=None,  # noqa: A002
            async_op=False,
        ):
            if op == avg and _is_gloo(group):
                n = dist.get_world_size(group)
                work = fn(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
                if async_op:
                    return _DivideOnWait(work, output, n)
                output.div_(n)
                return work
            return fn(output, input, op=op, group=group, async_op=async_op)

        return reduce_scatter_tensor

    why = "gloo has no ReduceOp.AVG: reduce with SUM and divide by the group size"
    pm.register_wrap(
        "torch.distributed.all_reduce", all_reduce_wrapper, feature=feature, reason=why
    )
    pm.register_wrap(
        "torch.distributed.reduce_scatter_tensor",
        reduce_scatter_wrapper,
        feature=feature,
        reason=why,
    )


class _Done:
    """The handle of a collective that already finished (emulations run synchronously)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _register_gloo_uneven(pm: PatchManager, feature: str) -> None:
    """gloo's list all-gather needs equal sizes and it has no list reduce-scatter; Megatron's
    MoE dispatchers use both with per-rank token counts (expert tensor parallelism)."""
    import torch.distributed as dist

    def all_gather_wrapper(fn):
        @functools.wraps(fn)
        def all_gather(tensor_list, tensor, group=None, async_op=False):
            shapes = {tuple(t.shape) for t in tensor_list}
            if len(shapes) == 1 or not _is_gloo(group):
                return fn(tensor_list, tensor, group=group, async_op=async_op)
            rows = max(t.shape[0] for t in tensor_list)
            padded = tensor.new_zeros((rows, *tensor.shape[1:]))
            padded[: tensor.shape[0]] = tensor
            parts = [torch.empty_like(padded) for _ in tensor_list]
            fn(parts, padded.contiguous(), group=group)
            for out, got in zip(tensor_list, parts, strict=True):
                out.copy_(got[: out.shape[0]])
            return _Done() if async_op else None

        return all_gather

    def reduce_scatter_wrapper(fn):
        @functools.wraps(fn)
        def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if not _is_gloo(group):
                return fn(output, input_list, op=op, group=group, async_op=async_op)
            full = torch.cat([t.reshape(-1) for t in input_list])
            dist.all_reduce(full, op=op, group=group)
            rank = dist.get_rank(group)
            start = sum(t.numel() for t in input_list[:rank])
            output.copy_(full[start : start + output.numel()].view_as(output))
            return _Done() if async_op else None

        return reduce_scatter

    why = "gloo: list all-gather of unequal sizes (padded) and list reduce-scatter (all-reduce)"
    pm.register_wrap(
        "torch.distributed.all_gather", all_gather_wrapper, feature=feature, reason=why
    )
    pm.register_wrap(
        "torch.distributed.reduce_scatter", reduce_scatter_wrapper, feature=feature, reason=why
    )
