"""File regions mapped copy-on-write as tensors, and which file bytes a buffer shows.

The restricted readers (:mod:`.torch_files`) build a checkpoint's tensors as views of such maps,
so nothing is copied until it is used; :func:`file_range` lets a writer (``convert``'s
``FileSink``) copy those bytes file to file instead of through memory.
"""

from __future__ import annotations

import io
import itertools
import mmap
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

_regions: dict[int, tuple[int, int, str, int]] = {}  # token -> (start, end, path, file offset)
# No lock guards the registry: the finalizers that drop entries may run inside any allocation
# (garbage collection), even one made while a lock is held. Single dict operations are atomic
# under the GIL, and lookups scan a copy.
_tokens = itertools.count()


def _forget(token: int) -> None:
    _regions.pop(token, None)


def map_file(path: str | Path, offset: int, length: int) -> torch.Tensor:
    """Bytes ``[offset, offset + length)`` of ``path`` as a uint8 tensor over a copy-on-write map.

    The map lives as long as any tensor or storage made from it; until then :func:`file_range`
    knows which file bytes its memory shows. Mapped tensors must not be written in place (the
    copy-on-write pages would then differ from the file, and the sink copies from the file).
    """
    if length <= 0:
        return torch.empty(0, dtype=torch.uint8)
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), offset + length - base, offset=base, access=mmap.ACCESS_COPY)
    # The tensor's storage starts at ``offset`` (a later ``.view(dtype)`` needs no alignment).
    out = torch.frombuffer(mm, dtype=torch.uint8, count=length, offset=offset - base)
    token = next(_tokens)
    start = out.data_ptr() - (offset - base)
    _regions[token] = (start, start + len(mm), os.path.abspath(path), base)
    weakref.finalize(mm, _forget, token)  # runs when the last tensor over the map is freed
    return out


def address(buf: Any) -> tuple[int, int]:
    """(address, size in bytes) of a C-contiguous buffer."""
    arr = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    return (arr.ctypes.data if arr.size else 0), arr.size


def file_range(buf: Any) -> tuple[str, int] | None:
    """(path, file offset) when ``buf``'s bytes are those of a region mapped by :func:`map_file`."""
    addr, size = address(buf)
    hits = [
        (p, base + addr - s)
        for s, e, p, base in _regions.copy().values()
        if s <= addr and addr + size <= e
    ]
    return hits[0] if len(hits) == 1 else None


class PositionedFile(io.RawIOBase):
    """A file whose position is a number kept here: every read or write says where it goes."""

    pos = 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos}.get(whence)
        self.pos = max(0, (self._end() if base is None else base) + pos)
        return self.pos

    def _end(self) -> int:
        raise io.UnsupportedOperation(f"{type(self).__name__} does not seek from its end")
