"""Writer and merger for Megatron's mmap indexed dataset (``MMIDIDX`` ``.idx`` + raw ``.bin``)."""

from __future__ import annotations

import os
import shutil
import struct

import numpy as np

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
        code, lengths, docs = read_index(prefix + ".idx")
        if CODE_DTYPES[code] != self.dtype:
            raise ValueError(f"{prefix}: dtype {CODE_DTYPES[code]} != {self.dtype}")
        with open(prefix + ".bin", "rb") as src:
            shutil.copyfileobj(src, self._bin, 16 << 20)
        for i in range(0, len(lengths), _BLOCK):
            self._lengths.write(np.asarray(lengths[i : i + _BLOCK], dtype=np.int32).tobytes())
        for i in range(1, len(docs), _BLOCK):
            block = np.asarray(docs[i : i + _BLOCK], dtype=np.int64) + self.sequences
            self._docs.write(block.tobytes())
        self.sequences += len(lengths)
        self.documents += len(docs) - 1
        self.tokens += int(
            sum(int(lengths[i : i + _BLOCK].sum()) for i in range(0, len(lengths), _BLOCK))
        )

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


def read_index(idx_path: str) -> tuple[int, np.ndarray, np.ndarray]:
    """Memory-map an ``.idx``: (dtype code, sequence lengths, document indices)."""
    with open(idx_path, "rb") as fh:
        header = fh.read(34)
    if header[:9] != MAGIC:
        raise ValueError(f"{idx_path}: not a Megatron indexed dataset index")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != VERSION:
        raise ValueError(f"{idx_path}: unsupported index version {version}")
    code = header[17]
    seqs, docs = struct.unpack("<QQ", header[18:34])
    lengths = np.memmap(idx_path, np.int32, "r", offset=34, shape=(seqs,)) if seqs else np.zeros(0)
    doc_off = 34 + seqs * 4 + seqs * 8
    doc_idx = np.memmap(idx_path, np.int64, "r", offset=doc_off, shape=(docs,))
    return code, lengths, doc_idx


def merge_datasets(prefixes: list[str], out_prefix: str, dtype: np.dtype | None = None) -> None:
    """Concatenate indexed datasets, in order, into ``out_prefix`` (written atomically)."""
    if dtype is None:
        dtype = CODE_DTYPES[read_index(prefixes[0] + ".idx")[0]]
    writer = IndexedWriter(out_prefix, dtype)
    try:
        for prefix in prefixes:
            writer.append_dataset(prefix)
    except BaseException:
        writer.abort()
        raise
    writer.finish()
