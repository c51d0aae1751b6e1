"""Safetensors headers validated in full before any tensor byte is read.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and ``data_offsets`` (relative to the end of the header), then the data. Every file
may be hostile: a header length beyond the file, offsets that point back into the header, into
another tensor or past the end, a shape that does not match its bytes, or JSON of the wrong
types are each one :class:`ConvertError` line naming the file, raised before anything is read.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from anyspeed.convert.errors import ConvertError

# The safetensors library refuses headers above 100 MB; so do we (no memory bomb).
MAX_HEADER = 100_000_000
# Every dtype code of the safetensors format, with its size in bytes.
ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class Entry:
    """One tensor of a validated header: its bytes are ``[begin, end)`` of the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(x: object) -> str:
    """``repr(x)`` cut to 60 characters: a hostile name or list stays one short line."""
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _nbytes(shape: list[int], itemsize: int, limit: int) -> int:
    """Bytes of ``shape``, or ``limit + 1`` once past ``limit`` (no product of huge numbers)."""
    if 0 in shape:
        return 0
    n = itemsize
    for d in shape:
        n *= d
        if n > limit:
            return limit + 1
    return n


def _entry(name: str, info: object, data_size: int) -> Entry:
    """The checked entry ``name`` (offsets relative to the data section); ValueError says why."""
    name = _short(name)
    if not isinstance(info, dict):
        raise ValueError(f"tensor {name} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise ValueError(f"tensor {name} has unknown dtype {_short(dtype)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"tensor {name} has shape {_short(shape)}, not a list of sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise ValueError(f"tensor {name} has data_offsets {_short(offsets)}, not two integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise ValueError(f"tensor {name} has data_offsets {_short(offsets)}, not 0 <= begin <= end")
    if end > data_size:
        raise ValueError(
            f"truncated: tensor {name} ends at data byte {_short(end)}, the file holds {data_size}"
        )
    need = _nbytes(shape, ITEMSIZE[dtype], data_size)
    if end - begin != need:
        needs = f"{need} bytes" if need <= data_size else "more bytes than the file holds"
        raise ValueError(
            f"tensor {name} holds {end - begin} bytes; shape {_short(shape)} of "
            f"{dtype} needs {needs}"
        )
    return Entry(dtype, tuple(shape), begin, end)


def _parse(raw: bytes) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # bad UTF-8 or JSON, or nesting deeper than Python's
        raise ValueError("bad header (not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError("bad header (not a JSON object)")
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta  # null, as the safetensors library allows
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("bad header (__metadata__ is not an object of strings)")
    return header


def read_header(path: str | Path) -> tuple[int, dict[str, Entry]]:
    """(absolute offset of the data section, checked entries) of safetensors file ``path``.

    The header length is bounded by the file and :data:`MAX_HEADER`; each entry has a known
    dtype, a shape of sizes >= 0 and offsets inside the data whose span is exactly the shape's
    bytes; no two tensors share a byte. Anything else is one ConvertError line."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("not a safetensors file (shorter than 8 bytes)")
            n = struct.unpack("<Q", head)[0]
            if n > min(size - 8, MAX_HEADER):
                raise ValueError(f"not a safetensors file (header length {n}, file size {size})")
            raw = f.read(n)
        header = _parse(raw)
        data_size = size - 8 - n
        entries = {name: _entry(name, info, data_size) for name, info in header.items()}
        spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
        for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
            if begin < end:
                raise ValueError(f"tensors {_short(a)} and {_short(b)} overlap")
    except ValueError as exc:
        raise ConvertError(f"{path}: {exc}") from None
    except OSError as exc:
        raise ConvertError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return 8 + n, entries
