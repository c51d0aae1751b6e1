"""What Megatron-Core declares safe to unpickle, anyspeed's restricted reader reads too.

``megatron.core.safe_globals.SAFE_GLOBALS`` is Megatron's own list of the classes its checkpoints
hold (it adds them to torch's ``weights_only`` allow-list). One object of each, written with
``torch.save``, reads back through :func:`anyspeed.safe_pickle.load_torch` exactly as plain
``torch.load(weights_only=False)`` reads it. ``io.BytesIO`` is the one that was missing: a
Megatron ``ShardedObject`` may hold one (``dist_checkpointing/test_serialization.py::
test_sharded_object_serialization``), and TE before 2.0 stores its extra state as one.

``torch.save`` writes pickle protocol 2, which names builtins the Python 2 way
(``__builtin__.set``); the restricted reader maps those names as pickle's own reader does
(``dist_checkpointing/test_serialization.py::TestNonStrictLoad`` stores a set), and the
allow-list still decides: ``__builtin__.eval`` is refused as ``builtins.eval``.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import signal
import types

import numpy as np
import pytest
import torch

from anyspeed import safe_pickle
from anyspeed.safe_pickle import UnsafePickleError


def _examples() -> dict:
    from megatron.core.enums import ModelType
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState
    from megatron.core.transformer.enums import AttnBackend, CudaGraphScope

    buffer = io.BytesIO(b"\x00serialized\xff")
    buffer.seek(3)
    return {
        "SimpleNamespace": types.SimpleNamespace(a=1, b=[2.0]),
        "PosixPath": pathlib.PosixPath("/ckpt/iter_0000001"),
        "ndarray": np.arange(6, dtype=np.float32).reshape(2, 3),
        "dtype": np.dtype("float16"),
        "UInt32DType": np.dtype(np.uint32),
        "Namespace": argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16),
        "AttnBackend": list(AttnBackend)[0],
        "CudaGraphScope": list(CudaGraphScope)[0],
        "ModelType": ModelType.encoder_or_decoder,
        "OptimizerConfig": OptimizerConfig(lr=1e-3),
        "RerunDiagnostic": list(RerunDiagnostic)[0],
        "RerunMode": list(RerunMode)[0],
        "RerunState": list(RerunState)[0],
        "BytesIO": buffer,
        "Signals": signal.SIGTERM,
    }


def _plain(obj: object) -> object:
    """A comparable form (buffers and arrays compare by content)."""
    if isinstance(obj, io.BytesIO):
        return ("BytesIO", obj.getvalue(), obj.tell())
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype, obj.tolist())
    return obj


def test_megatron_safe_globals_are_listed():
    from megatron.core.safe_globals import SAFE_GLOBALS

    names = {getattr(g, "__name__", "") for g in SAFE_GLOBALS} - {"_reconstruct"}
    assert names <= set(_examples()), names - set(_examples())


@pytest.mark.parametrize("name", sorted(_examples()))
def test_reads_like_plain_torch_load(name):
    data = io.BytesIO()
    torch.save({"value": _examples()[name]}, data)
    plain = torch.load(io.BytesIO(data.getvalue()), weights_only=False)["value"]
    ours = safe_pickle.load_torch(data.getvalue(), name)["value"]
    assert type(ours) is type(plain)
    assert _plain(ours) == _plain(plain)


@pytest.mark.parametrize(
    "value", [{1, 2}, frozenset({3}), bytearray(b"ab"), complex(1, 2), slice(1, 5, 2)]
)
def test_protocol_2_builtins_read_like_plain_torch_load(value):
    data = io.BytesIO()
    torch.save({"value": value}, data)  # protocol 2: __builtin__.<name>
    assert b"c__builtin__" in _data_pkl(data.getvalue())
    plain = torch.load(io.BytesIO(data.getvalue()), weights_only=False)
    assert safe_pickle.load_torch(data.getvalue(), "value") == plain


def _data_pkl(archive: bytes) -> bytes:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))


@pytest.mark.parametrize("module,name", [("__builtin__", "eval"), ("__builtin__", "getattr")])
def test_python_2_names_of_code_still_refused(module, name):
    payload = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."
    with pytest.raises(UnsafePickleError, match=f"refusing builtins\\.{name}"):
        safe_pickle.loads(payload, "payload")


@pytest.mark.parametrize("module,name", [("_io", "FileIO"), ("io", "open"), ("_io", "open")])
def test_other_io_names_still_refused(module, name):
    """A file object or ``open`` names a path to open: still refused (only the buffer reads)."""
    payload = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."
    with pytest.raises(UnsafePickleError, match=f"refusing {module}\\.{name}"):
        safe_pickle.loads(payload, "payload")
