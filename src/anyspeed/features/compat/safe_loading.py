"""Level-0 feature ``safe-loading``: checkpoints are read by anyspeed's restricted unpickler.

torch.distributed.checkpoint reads a torch_dist ``.metadata`` with a bare ``pickle.load`` and
Megatron's sharded objects (RNG state, optimizer groups) with ``torch.load(weights_only=False)``;
Megatron's ``common.pt`` and Megatron-LM's legacy files go through ``torch.load``, whose
restrictions an environment variable lifts and whose allow-list any import extends. Here all of
them read through :mod:`anyspeed.safe_pickle`, so a file cannot run code: ``.metadata`` by a
replaced reader, the rest by ``torch.load`` calls made inside the checkpoint-reading functions
below (a per-thread scope; ``torch.load`` elsewhere is unchanged).

``megatron-lm-safe-loading``: Megatron-LM's ``load_checkpoint`` first unpickles every pickle of
the checkpoint it is about to read (no tensor data); a refused file is one line from rank 0 and
every rank exits 1 (each rank reads the same files, so all agree without a collective).
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
    def torch_load(
        f: Any,
        map_location: Any = None,
        pickle_module: Any = None,
        *,
        weights_only: bool | None = None,
        mmap: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        escalate = getattr(_scope, "escalate", None)
        if escalate is None:
            return load(
                f, map_location, pickle_module, weights_only=weights_only, mmap=mmap, **kwargs
            )
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

    named = getattr(self, "_get_metadata_path", None)  # torch 2.6 has none (one global file)
    path = named(kwargs.get("rank")) if named else self.fs.concat_path(self.path, ".metadata")
    try:
        with self.fs.create_stream(path, "rb") as stream:
            metadata = safe_pickle.load(stream, os.fspath(path))
        if not isinstance(metadata, Metadata):
            raise safe_pickle.UnsafePickleError(
                f"{path}: not torch.distributed.checkpoint metadata"
            )
    except safe_pickle.UnsafePickleError as exc:
        _scope.metadata_refusal = exc  # torch before 2.13 drops it: see carrying_refusal
        raise
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def carrying_refusal(load_state_dict: Callable[..., Any]) -> Callable[..., Any]:
    """torch's ``_load_state_dict`` that fails with the ``.metadata`` refusal itself. Before
    torch 2.13 it swallows any error of ``read_metadata`` and fails on "metadata is None"."""

    @functools.wraps(load_state_dict)
    def with_the_refusal(*args: Any, **kwargs: Any) -> Any:
        _scope.metadata_refusal = None
        try:
            return load_state_dict(*args, **kwargs)
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            refusal = getattr(_scope, "metadata_refusal", None)
            if refusal is None or safe_pickle.find_refusal(exc) is not None:
                raise
            raise refusal from exc
        finally:
            _scope.metadata_refusal = None

    return with_the_refusal


def _scan_torch_save(data: bytes | str, what: str) -> None:
    """Unpickle a ``torch.save`` archive's ``data.pkl`` with meta-device storages (no tensor
    data is read); a non-zip file is left to the load itself (restricted too)."""
    import io

    import torch

    try:
        zf = torch._C.PyTorchFileReader(io.BytesIO(data) if isinstance(data, bytes) else data)
        pkl = zf.get_record("data.pkl")
    except RuntimeError:
        return

    def storage(pid: tuple) -> Any:
        dtype = pid[1].dtype
        nbytes = int(pid[4]) * torch._utils._element_size(dtype)
        meta = torch.UntypedStorage(nbytes, device="meta")
        return torch.storage.TypedStorage(wrap_storage=meta, dtype=dtype, _internal=True)

    unpickler = safe_pickle.Unpickler(io.BytesIO(pkl))
    unpickler.persistent_load = storage
    try:
        unpickler.load()
    except Exception as exc:  # noqa: BLE001 - every failure is the one error class
        raise safe_pickle.refusal(what, exc) from None


def scan_checkpoint(it_dir: str) -> None:
    """Unpickle every pickle of one checkpoint directory -- ``.metadata``, each ``*.pt`` and
    the sharded objects inside ``.distcp`` files -- without their tensor data. Every rank
    reads the same files, so all reach the same verdict without talking to each other."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for root, _, names in os.walk(it_dir):
        for name in sorted(names):
            path = os.path.join(root, name)
            if name.endswith(".pt") and not os.path.islink(path):
                _scan_torch_save(path, path)
    meta_path = os.path.join(it_dir, ".metadata")
    if not os.path.isfile(meta_path):
        return
    meta = safe_pickle.load(meta_path)
    kinds = getattr(meta, "state_dict_metadata", {})
    for index, info in (getattr(meta, "storage_data", None) or {}).items():
        name = os.fspath(getattr(info, "relative_path", ""))
        if not isinstance(kinds.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            continue
        if os.path.basename(name) != name or not os.path.isfile(os.path.join(it_dir, name)):
            continue  # the load reports a missing or misplaced file itself
        with open(os.path.join(it_dir, name), "rb") as f:
            f.seek(int(info.offset))
            _scan_torch_save(
                f.read(int(info.length)), f"{os.path.join(it_dir, name)} ({index.fqn})"
            )


def _checkpoint_dir(load_dir: Any, args: Any) -> str | None:
    """The iteration directory Megatron-LM is about to load from ``load_dir``, if any."""
    from anyspeed.checkpoint.files import iteration_dir, read_tracker

    if not isinstance(load_dir, str) or not os.path.isdir(load_dir):
        return None
    step = getattr(args, "ckpt_step", None)
    try:
        it = step if step is not None else read_tracker(load_dir)
    except ValueError:
        return None
    path = iteration_dir(load_dir, it) if it is not None else None
    return path if path and os.path.isdir(path) else None


def _loading_from(args: tuple, kwargs: dict, load_arg_at: int) -> str | None:
    """The checkpoint directory a call of Megatron-LM's loader will read (its ``load_arg``
    names the attribute of Megatron-LM's args), None when that cannot be told."""
    try:
        if load_arg_at == 1:
            margs = args[0]
        else:
            from megatron.training.global_vars import get_args

            margs = get_args()
    except (ImportError, AssertionError, IndexError):
        return None
    load_arg = kwargs.get("load_arg", args[load_arg_at] if len(args) > load_arg_at else "load")
    return _checkpoint_dir(getattr(margs, str(load_arg), None), margs)


def one_line_refusal(fn: Callable[..., Any], load_arg_at: int = 3) -> Callable[..., Any]:
    """A Megatron-LM loader that first checks every pickle of the checkpoint it is about to
    read; a refused file ends the run: one line from rank 0, exit 1 on every rank."""

    @functools.wraps(fn)
    def refusing_unsafe_files(*args: Any, **kwargs: Any) -> Any:
        try:
            with restricted(escalate=True):
                it_dir = _loading_from(args, kwargs, load_arg_at)
                if it_dir is not None:
                    scan_checkpoint(it_dir)
                return fn(*args, **kwargs)
        except BaseException as exc:
            message = str(exc) if isinstance(exc, _Refused) else safe_pickle.find_refusal(exc)
            if message is None:
                raise
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_rank() == 0 or isinstance(exc, _Refused):
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
        pm.register_wrap(
            "torch.load",
            restricted_torch_load,
            feature=self.name,
            reason="inside a checkpoint read (below), unpickle with anyspeed's "
            "allow-list instead of torch's, which imports extend and an "
            "environment variable switches off",
        )
        pm.register_replace(
            f"{_DCP}.filesystem.FileSystemReader.read_metadata",
            read_metadata,
            feature=self.name,
            reason="torch reads .metadata with a bare pickle.load: a planted __reduce__ would run",
        )
        pm.register_wrap(
            f"{_DCP}.state_dict_loader._load_state_dict",
            carrying_refusal,
            feature=self.name,
            reason="torch before 2.13 turns a refused .metadata into 'metadata is None'",
        )
        for target, why in (
            (
                f"{_DCP}.default_planner.DefaultLoadPlanner.load_bytes",
                "sharded objects (RNG "
                "state, optimizer groups) are read with torch.load(weights_only=False)",
            ),
            (
                f"{_DCP}.filesystem.FileSystemReader.read_data",
                "tensor chunks are read with torch.load",
            ),
            (f"{_COMMON}.load_common", "common.pt is read with torch.load"),
            (f"{_COMMON}.load_sharded_objects", "sharded-object files are read with torch.load"),
        ):
            pm.register_wrap(target, restricting, feature=self.name, reason=why)


class MegatronLMSafeLoading(Feature):
    name = "megatron-lm-safe-loading"
    level = 0
    description = (
        "Megatron-LM's load_checkpoint checks every pickle of the checkpoint first (one line "
        "from rank 0, exit 1 on every rank) and reads through the restricted unpickler"
    )

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        ok = steps.megatron_lm_available()
        return ok, "" if ok else "megatron.training not importable (needs a Megatron-LM checkout)"

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        why = (
            "Megatron-LM's checkpoint reads (legacy rank files, distrib_optim.pt, common.pt, "
            "sharded objects) checked first and read through the restricted unpickler; its "
            "legacy load turns any error into exit 0"
        )
        pm.register_wrap(
            "megatron.training.checkpointing.load_checkpoint",
            one_line_refusal,
            feature=self.name,
            reason=why,
        )
        pm.register_wrap(
            "megatron.training.checkpointing.load_args_from_checkpoint",
            functools.partial(one_line_refusal, load_arg_at=1),
            feature=self.name,
            reason=why,
        )
