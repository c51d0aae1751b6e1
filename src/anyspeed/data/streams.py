"""Input files as byte streams (gzip, zstd or plain), and what a damaged file raises."""

from __future__ import annotations

import contextlib
import gzip
import io
import sys
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO


class _ZstdStream(io.RawIOBase):
    """Decompresses every zstd frame of a file; a file that ends inside a frame is an error.

    (``zstandard``'s stream reader returns a truncated file as if it were complete, and stops
    after the first frame unless told otherwise.)"""

    def __init__(self, raw: BinaryIO) -> None:
        import zstandard

        self._raw = raw
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._frame = self._new()
        self._in_frame = False  # the current frame has been fed input but not finished
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while self._pos >= len(self._out):
            data = self._raw.read(1 << 14)  # small pieces bound what one call may inflate to
            if not data:
                if self._in_frame:
                    raise EOFError("the zstd stream ends inside a frame")
                return 0
            self._out, self._pos = self._feed(data), 0
        n = min(len(buf), len(self._out) - self._pos)
        buf[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n

    def _feed(self, data: bytes) -> bytes:
        out = []
        while data:
            self._in_frame = True
            out.append(self._frame.decompress(data))
            if not self._frame.eof:
                break
            data = self._frame.unused_data  # the next frame starts here
            self._frame, self._in_frame = self._new(), False
        return b"".join(out)


@contextlib.contextmanager
def open_binary(path: str, compression: str | None) -> Iterator[tuple[BinaryIO, Callable[[], int]]]:
    """Open a possibly compressed file as a buffered byte stream plus a progress probe
    (bytes of the file on disk consumed so far)."""
    raw = open(path, "rb")  # noqa: SIM115 - closed below
    if compression == "gzip":
        stream: BinaryIO = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[assignment]
    elif compression == "zstd":
        stream = io.BufferedReader(_ZstdStream(raw), buffer_size=1 << 20)  # type: ignore[arg-type]
    else:
        stream = raw
    try:
        yield stream, raw.tell
    finally:
        stream.close()
        raw.close()


def file_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged, truncated or mislabelled file raises (checked after the fact,
    so pyarrow and zstandard are only imported by the readers that need them)."""
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error]
    if "pyarrow" in sys.modules:
        errors.append(sys.modules["pyarrow"].ArrowException)
    if "zstandard" in sys.modules:
        errors.append(sys.modules["zstandard"].ZstdError)
    return tuple(errors)
