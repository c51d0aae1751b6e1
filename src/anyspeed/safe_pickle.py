"""Restricted unpickling for every checkpoint file anyspeed reads (nothing in a file can run code).

A pickle names the functions and classes it wants called; a bare ``pickle.load`` calls whatever
it names (``os.system``, ``builtins.eval``). :class:`Unpickler` resolves only the plain data a
checkpoint holds -- containers, tensors and storages, dtypes, ``torch.Size``, the
torch.distributed.checkpoint metadata classes, ``argparse.Namespace``, enum members, numpy
arrays and scalars, ``io.BytesIO`` buffers -- and sets object state only on instances of those
classes. Anything else, and any damage to the bytes, is one :class:`UnsafePickleError` line
naming the file. Protocol 2 (``torch.save``'s) names builtins the Python 2 way
(``__builtin__.set``): they are mapped as pickle's own reader maps them, then checked.

:func:`load` reads a plain pickle (a torch_dist ``.metadata``); :func:`load_torch` a
``torch.save`` file (``common.pt``, legacy ``model_optim_rng.pt``, RNG and optimizer records),
through ``torch.load`` with this module as its pickle module.
"""

from __future__ import annotations

import _compat_pickle
import enum
import importlib
import io
import os
import pickle
import re
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

__all__ = ["Unpickler", "UnsafePickleError", "find_refusal", "load", "load_torch", "loads"]


class UnsafePickleError(ValueError):
    """A checkpoint file that names something other than plain data, or is not a valid pickle."""


_DCP = "torch.distributed.checkpoint"
# module -> names a checkpoint may use. Each is a data class, an enum, or a function that only
# builds data from its arguments; none reaches the file system, a shell or the interpreter.
_ALLOWED: dict[str, frozenset[str]] = {
    m: frozenset(n)
    for m, n in {
        "collections": {"OrderedDict"},
        "builtins": {"set", "frozenset", "bytearray", "complex", "slice"},
        # an in-memory byte buffer: what a Megatron ShardedObject (and TE's pre-2.0 extra state)
        # may hold, on megatron.core.safe_globals' list; its state is bytes, a position, a dict
        "_io": {"BytesIO"},
        "io": {"BytesIO"},
        "argparse": {"Namespace"},
        "types": {"SimpleNamespace"},
        "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "signal": {"Signals"},
        "torch": {"Size", "device"},
        "torch.serialization": {"_get_layout"},
        f"{_DCP}.metadata": {
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        f"{_DCP}.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
        f"{_DCP}.filesystem": {"_StorageInfo", "_StoragePrefix"},
        "numpy": {"ndarray", "dtype"},
        "numpy.core.multiarray": {"_reconstruct", "scalar"},
        "numpy._core.multiarray": {"_reconstruct", "scalar"},
        "megatron.core.optimizer.optimizer_config": {"OptimizerConfig"},
    }.items()
}


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks, metadata=None):
    """torch's tensor rebuild, for a storage of this file and no backward hooks only."""
    import torch

    if not isinstance(storage, torch.storage.TypedStorage) or hooks:
        raise pickle.UnpicklingError("a tensor record with a foreign storage or backward hooks")
    return torch._utils._rebuild_tensor_v2(
        storage, offset, size, stride, requires_grad, hooks, metadata
    )


def _rebuild_parameter(data, requires_grad, hooks):
    """torch's Parameter rebuild, for a tensor and no backward hooks only."""
    import torch

    if not isinstance(data, torch.Tensor) or hooks:
        raise pickle.UnpicklingError("a parameter record with backward hooks")
    return torch._utils._rebuild_parameter(data, requires_grad, hooks)


def _encode(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for bytes: latin-1 of a str only."""
    if not isinstance(text, str) or encoding.replace("-", "") != "latin1":
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}")
    return text.encode("latin-1")


# Megatron modules whose enums Megatron-LM stores in ``args`` (imported to read them).
_MEGATRON_ENUM_MODULES = frozenset(
    {
        "megatron.core.enums",
        "megatron.core.transformer.enums",
        "megatron.core.rerun_state_machine",
    }
)

_CHECKED: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("_codecs", "encode"): _encode,
}


def _resolve(module: str, name: str) -> Any:
    """The object ``module.name`` when a checkpoint may use it, else None."""
    if (module, name) in _CHECKED:
        return _CHECKED[(module, name)]
    allowed = name in _ALLOWED.get(module, ())
    megatron_enum = module.startswith("megatron.") and name.isidentifier()
    torch_type = module == "torch" and name.isidentifier()
    if not (allowed or megatron_enum or torch_type or module == "numpy.dtypes"):
        return None
    try:
        if megatron_enum and module not in _MEGATRON_ENUM_MODULES:
            owner = sys.modules[module]  # only what this process has imported
        else:
            owner = importlib.import_module(module)
        # the module's own names only: no lazy __getattr__ that imports more
        obj = getattr(owner, name) if allowed else vars(owner)[name]
    except (ImportError, AttributeError, KeyError):
        return None
    if allowed:
        return obj
    if megatron_enum:
        return obj if isinstance(obj, type) and issubclass(obj, enum.Enum) else None
    if torch_type:  # dtypes (torch.float32) and the storage classes of a record's pid
        import torch

        if isinstance(obj, torch.dtype):
            return obj
        if name.endswith("Storage"):
            return torch.serialization.StorageType(name)  # a token: .dtype, not callable
        return None
    import numpy  # numpy.dtypes: the dtype classes (UInt32DType, ...)

    return obj if isinstance(obj, type) and issubclass(obj, numpy.dtype) else None


def _buildable(inst: Any) -> bool:
    """Whether BUILD may set ``inst``'s state: an instance (not a class, not an enum member) of
    an allowed data class, or a numpy array / dtype (their ``__setstate__`` takes only data)."""
    if isinstance(inst, (type, enum.Enum)):
        return False
    cls = type(inst)
    if cls.__name__ in _ALLOWED.get(cls.__module__, ()):
        return True
    numpy = importlib.import_module("numpy") if cls.__module__.startswith("numpy") else None
    return numpy is not None and isinstance(inst, (numpy.ndarray, numpy.dtype))


class Unpickler(pickle._Unpickler):
    """A pickle reader that resolves only the names above and builds only their instances.

    The pure-Python reader is used because its opcode table can be changed: BUILD (set an
    object's state) is checked too, so a file cannot rewrite a class or an enum member.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise pickle.UnpicklingError("refusing a global not named by two strings")
        if self.proto < 3 and self.fix_imports:  # type: ignore[attr-defined]
            # protocol 2 (torch.save's) writes Python 2 names: __builtin__.set is builtins.set,
            # mapped as pickle's own reader maps them; the allow-list then decides
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        obj = _resolve(module, name)
        if obj is None:
            raise pickle.UnpicklingError(f"refusing {module}.{name}")
        return obj

    def load_build(self) -> None:
        # The pure-Python unpickler's stack; its type stubs do not declare it.
        target = self.stack[-2]  # type: ignore[attr-defined]
        if not _buildable(target):
            raise pickle.UnpicklingError(f"refusing to set the state of {target!r:.60}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


_WHY = "a checkpoint holds plain data only; this file was not written by Megatron or anyspeed"
# The two forms of the message, found again in the text of an error that wraps one.
_MESSAGE = re.compile(
    r"\S+: (refusing [^\n]*? \(" + _WHY + r"[^)\n]*\)|"
    r"not a readable checkpoint pickle \([^\n]*)"
)


def refusal(what: str, exc: BaseException) -> UnsafePickleError:
    """The one-line error for ``exc``, raised while unpickling ``what``."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("refusing"):
        return UnsafePickleError(f"{what}: {text} ({_WHY}, or was tampered with)")
    return UnsafePickleError(f"{what}: not a readable checkpoint pickle ({text})")


def find_refusal(exc: BaseException) -> str | None:
    """The one-line message of an :class:`UnsafePickleError` inside ``exc`` -- its causes, the
    per-rank failures torch.distributed.checkpoint collects, or their text -- else None."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UnsafePickleError):
            return str(e)
        failures = getattr(e, "failures", None)
        todo += [e.__cause__, e.__context__, getattr(e, "exc", None)]
        todo += list(failures.values()) if isinstance(failures, dict) else []
    found = _MESSAGE.search(str(exc))
    return found.group(0) if found else None


def loads(data: bytes, what: str) -> Any:
    """The object pickled in ``data`` (``what`` names it in the one-line error)."""
    try:
        return Unpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - every failure is the one error class
        raise refusal(what, exc) from None


def load(file: BinaryIO | str | os.PathLike[str], what: str | None = None, **_: Any) -> Any:
    """The object pickled in ``file`` (a path or a binary file). Also ``torch.load``'s
    ``pickle_module.load`` (the keyword arguments it passes are the defaults here)."""
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as f:
            return loads(f.read(), what or os.fspath(file))
    name = what or str(getattr(file, "name", "checkpoint data"))
    try:  # one pickle from the file's position (torch's pre-1.6 format holds several)
        return Unpickler(file).load()
    except Exception as exc:  # noqa: BLE001 - every failure is the one error class
        raise refusal(name, exc) from None


def load_torch(
    source: BinaryIO | str | os.PathLike[str] | bytes,
    what: str | None = None,
    map_location: Any = "cpu",
    *,
    mmap: bool | None = None,
) -> Any:
    """A ``torch.save`` file (zip or pre-1.6 format) read by ``torch.load`` with this module's
    :class:`Unpickler`; any failure is one :class:`UnsafePickleError` naming ``what``."""
    import torch

    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    name = what or (
        os.fspath(source)
        if isinstance(source, (str, os.PathLike))
        else str(getattr(source, "name", "checkpoint data"))
    )
    load_fn = getattr(torch.load, "__wrapped__", torch.load)  # torch's own, not a wrapper
    try:
        return load_fn(
            source,
            map_location=map_location,
            pickle_module=sys.modules[__name__],
            weights_only=False,
            mmap=mmap,
        )
    except UnsafePickleError as exc:
        raise UnsafePickleError(f"{name}: {str(exc).split(': ', 1)[-1]}") from None
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is the one error class
        raise refusal(name, exc) from None
