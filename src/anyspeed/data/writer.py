"""Writer and merger for Megatron's mmap indexed dataset (``MMIDIDX`` ``.idx`` + raw ``.bin``)."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import struct
from dataclasses import dataclass

import numpy as np

from anyspeed.checkpoint.files import pid_alive

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
CODE_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}
_BLOCK = 1 << 20  # index entries handled per step when streaming the .idx


def dataset_paths(prefix: str) -> tuple[str, str]:
    """``(prefix.bin, prefix.idx)``."""
    return prefix + ".bin", prefix + ".idx"


class IndexedWriter:
    """Appends sequences to ``<final>.tmp-<pid>`` files and renames them into place on close.

    Sequence lengths and document boundaries are spooled to disk, so memory stays flat
    however many documents are written.
    """

    def __init__(self, prefix: str, dtype: type[np.generic] | np.dtype) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self.code = DTYPE_CODES[self.dtype]
        tag = f".tmp-{os.getpid()}"
        self.bin_final, self.idx_final = dataset_paths(prefix)
        self.tmp = [self.bin_final + tag, self.idx_final + tag, prefix + ".lengths" + tag]
        self.tmp.append(prefix + ".docs" + tag)
        self._files: list = []
        try:  # an interrupt between two opens must not leave the first file behind
            for path in (self.tmp[0], self.tmp[2], self.tmp[3]):
                self._files.append(open(path, "wb"))  # noqa: SIM115 - closed in finish/abort
        except BaseException:
            self.abort()
            raise
        self._bin, self._lengths, self._docs = self._files
        self.sequences = 0
        self.documents = 0
        self.tokens = 0

    def add(self, data: np.ndarray, lengths: np.ndarray) -> None:
        """Append sequences (each its own document) given their concatenation and lengths."""
        arr = np.asarray(data)
        if arr.dtype != self.dtype:
            lo, hi = np.iinfo(self.dtype).min, np.iinfo(self.dtype).max
            if arr.size and (arr.min() < lo or arr.max() > hi):
                raise ValueError(f"value out of range for {self.dtype} in {self.prefix}")
            arr = arr.astype(self.dtype)
        self._bin.write(arr.tobytes())
        lengths = np.asarray(lengths, dtype=np.int32)
        self._lengths.write(lengths.tobytes())
        ends = np.arange(self.sequences + 1, self.sequences + len(lengths) + 1, dtype=np.int64)
        self._docs.write(ends.tobytes())
        self.sequences += len(lengths)
        self.documents += len(lengths)
        self.tokens += int(arr.size)

    def append_dataset(self, prefix: str) -> None:
        """Append a whole existing dataset (same dtype) - used to merge partitions."""
        index = check_dataset(prefix)
        lengths, docs = index.lengths, index.documents
        if index.dtype != self.dtype:
            raise ValueError(f"{prefix}: dtype {index.dtype} != {self.dtype}")
        with open(prefix + ".bin", "rb") as src:
            shutil.copyfileobj(src, self._bin, 16 << 20)
        for i in range(0, len(lengths), _BLOCK):
            self._lengths.write(np.asarray(lengths[i : i + _BLOCK], dtype=np.int32).tobytes())
        for i in range(1, len(docs), _BLOCK):
            block = np.asarray(docs[i : i + _BLOCK], dtype=np.int64) + self.sequences
            self._docs.write(block.tobytes())
        self.sequences += len(lengths)
        self.documents += len(docs) - 1
        self.tokens += index.tokens

    def finish(self) -> tuple[str, str]:
        """Write the ``.idx``, fsync, and atomically rename both files to their final names."""
        for fh in (self._bin, self._lengths, self._docs):
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
        lengths = np.memmap(self.tmp[2], np.int32, "r") if self.sequences else np.zeros(0, np.int32)
        docs = np.memmap(self.tmp[3], np.int64, "r") if self.documents else np.zeros(0, np.int64)
        with open(self.tmp[1], "wb") as idx:
            idx.write(MAGIC)
            idx.write(struct.pack("<Q", VERSION))
            idx.write(struct.pack("<B", self.code))
            idx.write(struct.pack("<Q", self.sequences))
            idx.write(struct.pack("<Q", self.documents + 1))
            for i in range(0, self.sequences, _BLOCK):
                idx.write(np.asarray(lengths[i : i + _BLOCK], dtype=np.int32).tobytes())
            offset = 0
            for i in range(0, self.sequences, _BLOCK):
                sizes = np.asarray(lengths[i : i + _BLOCK], dtype=np.int64) * self.dtype.itemsize
                pointers = np.cumsum(sizes) - sizes + offset
                offset += int(sizes.sum())
                idx.write(pointers.astype(np.int64).tobytes())
            idx.write(np.zeros(1, np.int64).tobytes())
            for i in range(0, self.documents, _BLOCK):
                idx.write(np.asarray(docs[i : i + _BLOCK], dtype=np.int64).tobytes())
            idx.flush()
            os.fsync(idx.fileno())
        del lengths, docs
        os.replace(self.tmp[0], self.bin_final)
        os.replace(self.tmp[1], self.idx_final)  # the .idx appears last: its presence means done
        self._cleanup()
        return self.bin_final, self.idx_final

    def abort(self) -> None:
        """Close and delete every temporary file; the final names are never touched."""
        for fh in self._files:
            fh.close()
        self._cleanup()

    def _cleanup(self) -> None:
        remove_temp_files(self.prefix)


def remove_temp_files(prefix: str) -> None:
    """Delete this process's ``<prefix>.*.tmp-<pid>`` files (writers that never finished)."""
    for suffix in (".bin", ".idx", ".lengths", ".docs"):
        try:
            os.remove(f"{prefix}{suffix}.tmp-{os.getpid()}")
        except FileNotFoundError:
            pass


# What a killed run leaves: a writer's ``.<part>.tmp-<pid>`` files, and the partial datasets
# of ``--partitions`` (``.partNNN.tmp-<parent>.<part>``, with their own writers' temp files).
_TEMP_NAME = re.compile(r"(?:\.part\d+\.tmp-(\d+))?\.(?:bin|idx|lengths|docs)(?:\.tmp-(\d+))?")


def remove_stale_temp_files(prefix: str) -> list[str]:
    """Delete the temporary files of ``prefix`` whose every named PID is not a live process
    (a killed run's leftovers); a live run's files are left alone. Returns what was removed."""
    removed = []
    for path in sorted(glob.glob(glob.escape(prefix) + ".*")):
        match = _TEMP_NAME.fullmatch(path[len(prefix) :])
        pids = [int(p) for p in match.groups() if p] if match else []
        if pids and not any(pid_alive(pid) for pid in pids):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
                removed.append(path)
    return removed


class IndexFileError(ValueError):
    """An ``.idx`` (or its ``.bin``) that does not describe a readable dataset; one line."""


@dataclass(frozen=True)
class Index:
    """A validated ``.idx``: token dtype, sequence lengths and document boundaries (mapped)."""

    path: str
    dtype: np.dtype
    lengths: np.ndarray
    documents: np.ndarray
    tokens: int

    @property
    def bin_bytes(self) -> int:
        """The exact size the matching ``.bin`` must have."""
        return self.tokens * self.dtype.itemsize


_HEADER = 34  # magic (9), version (8), dtype code (1), sequences (8), document entries (8)


def read_index(idx_path: str) -> Index:
    """Memory-map an ``.idx`` after checking it is whole and consistent; IndexFileError if not.

    Checked before any array is mapped: magic, version, dtype code, and that the counts in the
    header give exactly the file's size (so no read leaves the file); then, streaming in
    blocks: lengths non-negative, pointers contiguous from 0, document indices rising from 0 to
    the sequence count.
    """
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as fh:
        header = fh.read(_HEADER)
    if len(header) < _HEADER or header[:9] != MAGIC:
        raise IndexFileError(
            f"{idx_path}: not a Megatron indexed dataset index (no MMIDIDX header)"
        )
    version, code, seqs, docs = struct.unpack("<QBQQ", header[9:])
    if version != VERSION:
        raise IndexFileError(f"{idx_path}: unsupported index version {version} (expected 1)")
    if code not in CODE_DTYPES:
        raise IndexFileError(f"{idx_path}: unknown token dtype code {code}")
    expected = _HEADER + 12 * seqs + 8 * docs
    if expected != size or docs < 1:
        raise IndexFileError(
            f"{idx_path}: the header describes {seqs} sequences and {docs} document entries "
            f"({expected} bytes) but the file has {size} bytes (truncated or damaged)"
        )
    dtype = CODE_DTYPES[code]
    lengths = (
        np.memmap(idx_path, np.int32, "r", _HEADER, (seqs,)) if seqs else np.zeros(0, np.int32)
    )
    pointers = np.memmap(idx_path, np.int64, "r", _HEADER + 4 * seqs, (seqs,)) if seqs else lengths
    documents = np.memmap(idx_path, np.int64, "r", _HEADER + 12 * seqs, (docs,))
    tokens = _check_pointers(idx_path, lengths, pointers, dtype.itemsize)
    _check_documents(idx_path, documents, seqs)
    return Index(idx_path, dtype, lengths, documents, tokens)


def _check_pointers(path: str, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> int:
    """Total tokens, after checking each sequence starts where the previous one ends."""
    tokens = 0
    for i in range(0, len(lengths), _BLOCK):
        block = np.asarray(lengths[i : i + _BLOCK], dtype=np.int64)
        if block.size and block.min() < 0:
            raise IndexFileError(f"{path}: negative sequence length near sequence {i}")
        ends = np.cumsum(block) + tokens
        starts = (ends - block) * itemsize
        bad = np.flatnonzero(np.asarray(pointers[i : i + _BLOCK]) != starts)
        if bad.size:
            raise IndexFileError(
                f"{path}: sequence {i + int(bad[0])} does not start where the previous one ends"
            )
        tokens = int(ends[-1]) if ends.size else tokens
        if tokens * itemsize >= 1 << 62:  # no real file is this large; stop before int64 wraps
            raise IndexFileError(f"{path}: sequence lengths add up to an impossible size")
    return tokens


def _check_documents(path: str, documents: np.ndarray, seqs: int) -> None:
    """Document boundaries rise from 0 to the number of sequences."""
    if documents[0] != 0 or documents[-1] != seqs:
        raise IndexFileError(
            f"{path}: document boundaries run from {documents[0]} to {documents[-1]}, "
            f"not from 0 to the {seqs} sequences"
        )
    for i in range(0, len(documents), _BLOCK):
        block = np.asarray(documents[i : i + _BLOCK + 1])
        if block.size > 1 and np.diff(block).min() < 0:
            raise IndexFileError(f"{path}: document boundaries decrease near entry {i}")


def check_dataset(prefix: str) -> Index:
    """The validated index of ``prefix``, after checking ``prefix.bin`` has exactly the size it
    describes (a truncated ``.bin``, or an ``.idx`` of another dataset, fails here)."""
    bin_path, idx_path = dataset_paths(prefix)
    index = read_index(idx_path)
    size = os.path.getsize(bin_path)
    if size != index.bin_bytes:
        raise IndexFileError(
            f"{bin_path} has {size} bytes but {idx_path} describes {index.bin_bytes} "
            f"({index.tokens} tokens of {index.dtype}): the .bin is truncated or the two files "
            "belong to different datasets; preprocess the data again"
        )
    return index


def merge_datasets(prefixes: list[str], out_prefix: str, dtype: np.dtype | None = None) -> None:
    """Concatenate indexed datasets, in order, into ``out_prefix`` (written atomically)."""
    if dtype is None:
        dtype = read_index(prefixes[0] + ".idx").dtype
    writer = IndexedWriter(out_prefix, dtype)
    try:
        for prefix in prefixes:
            writer.append_dataset(prefix)
    except BaseException:
        writer.abort()
        raise
    writer.finish()
