"""Level-0 feature ``safe-loading``: checkpoints are read by anyspeed's restricted unpickler.

torch.distributed.checkpoint reads a torch_dist ``.metadata`` with a bare ``pickle.load`` and
Megatron's sharded objects (RNG state, optimizer groups) with ``torch.load(weights_only=False)``;
Megatron's ``common.pt`` and Megatron-LM's legacy files go through ``torch.load``, whose
restrictions an environment variable lifts and whose allow-list any import extends. Here all of
them read through :mod:`anyspeed.safe_pickle`, so a file cannot run code: ``.metadata`` by a
replaced reader, the rest by ``torch.load`` calls made inside the checkpoint-reading functions
below (a per-thread scope; ``torch.load`` elsewhere is unchanged). Inside Megatron-LM a refused
file is one line from rank 0 and every rank exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from anyspeed import safe_pickle
from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature
from anyspeed.features.compat import megatron_lm_steps as steps
from anyspeed.patching import PatchManager

_scope = threading.local()
_DCP = "torch.distributed.checkpoint"
_COMMON = "megatron.core.dist_checkpointing.strategies.common.TorchCommonLoadStrategy"


class _Refused(BaseException):
    """Carries a refusal past Megatron-LM's ``except Exception`` around its legacy load."""


@contextlib.contextmanager
def restricted(escalate: bool = False) -> Iterator[None]:
    """``torch.load`` in this thread reads through the restricted unpickler while inside."""
    before = getattr(_scope, "escalate", None)
    _scope.escalate = escalate
    try:
        yield
    finally:
        _scope.escalate = before


def restricting(fn: Callable[..., Any], escalate: bool = False) -> Callable[..., Any]:
    """``fn`` with every ``torch.load`` it makes going through :mod:`anyspeed.safe_pickle`."""

    @functools.wraps(fn)
    def inside_restricted_scope(*args: Any, **kwargs: Any) -> Any:
        with restricted(escalate):
            return fn(*args, **kwargs)

    return inside_restricted_scope


def restricted_torch_load(load: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.load`` that, inside :func:`restricted`, unpickles with anyspeed's allow-list."""

    @functools.wraps(load)
    def torch_load(f: Any, map_location: Any = None, pickle_module: Any = None, *,
                   weights_only: bool | None = None, mmap: bool | None = None,
                   **kwargs: Any) -> Any:  # fmt: skip
        escalate = getattr(_scope, "escalate", None)
        if escalate is None:
            return load(f, map_location, pickle_module, weights_only=weights_only, mmap=mmap,
                        **kwargs)  # fmt: skip
        what = os.fspath(f) if isinstance(f, (str, os.PathLike)) else None
        try:
            return safe_pickle.load_torch(f, what, map_location, mmap=mmap)
        except safe_pickle.UnsafePickleError as exc:
            if escalate:
                raise _Refused(str(exc)) from None
            raise

    return torch_load


def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
    """FileSystemReader.read_metadata through the restricted unpickler (torch's uses pickle)."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as stream:
        metadata = safe_pickle.load(stream, os.fspath(path))
    if not isinstance(metadata, Metadata):
        raise safe_pickle.UnsafePickleError(f"{path}: not torch.distributed.checkpoint metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def one_line_refusal(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A Megatron-LM loader whose refused files end the run: one line from rank 0, exit 1."""

    @functools.wraps(fn)
    def refusing_unsafe_files(*args: Any, **kwargs: Any) -> Any:
        try:
            with restricted(escalate=True):
                return fn(*args, **kwargs)
        except BaseException as exc:
            message = str(exc) if isinstance(exc, _Refused) else safe_pickle.find_refusal(exc)
            if message is None:
                raise
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"anyspeed: error: {message.splitlines()[0]}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    return refusing_unsafe_files


class SafeLoading(Feature):
    name = "safe-loading"
    level = 0
    description = (
        "checkpoint files (.metadata, common.pt, sharded objects, legacy .pt) are unpickled with "
        "an allow-list of plain data: a file cannot run code"
    )

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        pm.register_wrap("torch.load", restricted_torch_load, feature=self.name,
                         reason="inside a checkpoint read (below), unpickle with anyspeed's "
                         "allow-list instead of torch's, which imports extend and an "
                         "environment variable switches off")  # fmt: skip
        pm.register_replace(f"{_DCP}.filesystem.FileSystemReader.read_metadata", read_metadata,
                            feature=self.name, reason="torch reads .metadata with a bare "
                            "pickle.load: a planted __reduce__ would run")  # fmt: skip
        for target, why in (
            (f"{_DCP}.default_planner.DefaultLoadPlanner.load_bytes", "sharded objects (RNG "
             "state, optimizer groups) are read with torch.load(weights_only=False)"),
            (f"{_DCP}.filesystem.FileSystemReader.read_data", "tensor chunks are read with "
             "torch.load"),
            (f"{_COMMON}.load_common", "common.pt is read with torch.load"),
            (f"{_COMMON}.load_sharded_objects", "sharded-object files are read with torch.load"),
        ):  # fmt: skip
            pm.register_wrap(target, restricting, feature=self.name, reason=why)
        if not steps.megatron_lm_available():
            return
        for target in ("load_checkpoint", "load_args_from_checkpoint"):
            pm.register_wrap(f"megatron.training.checkpointing.{target}", one_line_refusal,
                             feature=self.name, reason="Megatron-LM's checkpoint reads "
                             "(legacy files, distrib_optim.pt) through the restricted "
                             "unpickler; a refused file is one line and exit 1")  # fmt: skip
