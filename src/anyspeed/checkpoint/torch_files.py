"""``torch.save`` files read without trusting them: tensors as views of the mapped file.

:func:`load_torch_file` builds the tensors of a ``torch.save`` record (a legacy rank file, a
chunk of a ``.distcp``) as views of the mapped file, unpickling with anyspeed's restricted
:class:`anyspeed.safe_pickle.Unpickler`; :func:`weights_only_load` reads what is not a zip
archive through :func:`anyspeed.safe_pickle.load_torch`. Every failure is one
:class:`CheckpointFileError` line.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from anyspeed import safe_pickle
from anyspeed.checkpoint.errors import CheckpointFileError
from anyspeed.checkpoint.file_maps import PositionedFile, map_file


class _Bytes(PositionedFile):
    """A read-only file over a buffer, for the zip reader (no copy of the data records)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view = view

    def readable(self) -> bool:
        return True

    def _end(self) -> int:
        return len(self.view)

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self.view) - self.pos))
        memoryview(b).cast("B")[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n


def weights_only_load(source: Any, what: str) -> Any:
    """A ``torch.save`` file or buffer read into memory by the restricted unpickler (for what is
    not a zip archive :func:`load_torch_file` can map); CheckpointFileError naming ``what``
    otherwise."""
    try:
        return safe_pickle.load_torch(source, what)
    except safe_pickle.UnsafePickleError as exc:
        raise CheckpointFileError(str(exc)) from None


def load_torch_file(path: str | Path, offset: int, length: int, what: str) -> Any:
    """The object ``torch.save`` wrote at ``[offset, offset + length)`` of ``path``, its tensors
    views of the mapped file (no copy), unpickled by :class:`anyspeed.safe_pickle.Unpickler`.
    A one-line :class:`CheckpointFileError` otherwise."""
    raw = map_file(path, offset, length)
    view = memoryview(raw.numpy())
    src = _Bytes(view)
    try:
        try:
            zf = torch._C.PyTorchFileReader(src)
            records = set(zf.get_all_records())
        except RuntimeError:
            msg = f"{what}: not a torch.save zip archive, or truncated"
            raise CheckpointFileError(msg) from None
        if "data.pkl" not in records:
            raise CheckpointFileError(f"{what}: no data.pkl in the archive")
        if "byteorder" in records and zf.get_record("byteorder") != b"little":
            raise CheckpointFileError(f"{what}: saved big-endian; only little-endian is read")
        storages: dict[str, torch.storage.TypedStorage] = {}

        def persistent_load(pid: tuple) -> torch.storage.TypedStorage:
            _, storage_type, key, _location, numel = pid
            dtype = storage_type.dtype  # a StorageType token from the restricted unpickler
            if key not in storages:
                name = f"data/{key}"
                nbytes = numel * torch._utils._element_size(dtype)
                at = zf.get_record_offset(name) if name in records else -1
                if at < 0 or at + nbytes > length:
                    raise CheckpointFileError(f"{what}: storage {key} is missing or truncated")
                untyped = raw.untyped_storage()[at : at + nbytes]
                storages[key] = torch.storage.TypedStorage(
                    wrap_storage=untyped, dtype=dtype, _internal=True
                )
            return storages[key]

        unpickler = safe_pickle.Unpickler(io.BytesIO(zf.get_record("data.pkl")))
        unpickler.persistent_load = persistent_load
        try:
            return unpickler.load()
        except CheckpointFileError:
            raise
        except Exception as exc:  # noqa: BLE001 - one line naming the file
            raise CheckpointFileError(str(safe_pickle.refusal(what, exc))) from None
    finally:
        src.close()
        view.release()
