"""Streaming readers for jsonl/json/parquet/arrow/csv/txt inputs (optionally gzip/zstd)."""

from __future__ import annotations

import codecs
import glob
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from anyspeed.data.errors import DataError, RecordError, UsageError
from anyspeed.data.streams import file_errors, open_binary

FORMATS = ("jsonl", "json", "parquet", "arrow", "csv", "txt")
_EXT_FORMAT = {
    "jsonl": "jsonl",
    "ndjson": "jsonl",
    "json": "json",
    "parquet": "parquet",
    "arrow": "arrow",
    "feather": "arrow",
    "ipc": "arrow",
    "csv": "csv",
    "txt": "txt",
    "text": "txt",
}
_EXT_COMPRESSION = {"gz": "gzip", "gzip": "gzip", "zst": "zstd", "zstd": "zstd"}

# Payload kinds carried from the reader to the (possibly remote) decode step.
JSON_LINE = "J"  # raw bytes of one JSON object
TEXT_LINE = "T"  # raw bytes of one plain-text document
RECORD = "R"  # an already decoded dict
ERROR = "E"  # a RecordError found while reading

Item = tuple[int, str, Any]  # (1-based line or row, kind, payload)
BOM = b"\xef\xbb\xbf"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how JSON text spells a surrogate
_SURROGATE = re.compile("[\ud800-\udfff]")  # after json.loads, any surrogate left is lone


@dataclass(frozen=True)
class InputFile:
    """One input file with its detected format, compression and on-disk size."""

    path: str
    fmt: str
    compression: str | None
    size: int


def detect_format(path: str) -> tuple[str | None, str | None]:
    """Guess (format, compression) from a file name such as ``x.jsonl.zst``."""
    parts = os.path.basename(path).lower().split(".")
    compression = None
    if len(parts) > 1 and parts[-1] in _EXT_COMPRESSION:
        compression = _EXT_COMPRESSION[parts[-1]]
        parts = parts[:-1]
    fmt = _EXT_FORMAT.get(parts[-1]) if len(parts) > 1 else None
    return fmt, compression


def resolve_inputs(spec: str, fmt: str | None = None) -> list[InputFile]:
    """Expand ``--input`` (file, glob or directory of one format) into a sorted file list."""
    if os.path.isdir(spec):
        paths = sorted(
            os.path.join(root, name)
            for root, _, names in os.walk(spec)
            for name in names
            if not name.startswith(".")
        )
        from_dir = True
    elif os.path.isfile(spec):
        paths, from_dir = [spec], False
    else:
        paths, from_dir = (
            sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)),
            True,
        )
        if not paths:
            raise UsageError(f"--input {spec!r}: no such file, directory or glob match")
    files = []
    for path in paths:
        got, compression = detect_format(path)
        got = fmt or got
        if got is None:
            if from_dir:
                continue
            raise UsageError(f"--input {path!r}: unknown format; pass --input-format")
        files.append(InputFile(path, got, compression, os.path.getsize(path)))
    if not files:
        raise UsageError(f"--input {spec!r}: no input files of a known format")
    kinds = Counter(f.fmt for f in files)
    if len(kinds) > 1:
        seen = ", ".join(f"{k} ({n})" for k, n in kinds.most_common())
        raise UsageError(f"--input {spec!r} mixes formats: {seen}; use one format or a glob")
    return files


def _describe(f: InputFile) -> str:
    return f"{f.compression}-compressed {f.fmt}" if f.compression else f.fmt


class Reader:
    """Iterates ``Item`` tuples from one input file; ``position()`` reports bytes consumed."""

    def __init__(self, f: InputFile, columns: list[str] | None = None, doc_per_file: bool = False):
        self.file = f
        self.columns = columns
        self.doc_per_file = doc_per_file
        self._probe: Callable[[], int] = lambda: 0

    def position(self) -> int:
        """Bytes of the on-disk file consumed so far (compressed size for compressed files)."""
        try:
            return min(self._probe(), self.file.size)
        except (ValueError, OSError):
            return self.file.size

    def __iter__(self) -> Iterator[Item]:
        """Items in file order; a file that cannot be read to its end is a DataError."""
        try:
            yield from self._items()
        except file_errors() as exc:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(
                f"{self.file.path}: cannot read this {_describe(self.file)} file ({detail}); "
                "it is damaged, truncated or not in that format - replace it, remove it, or "
                "pass the right --input-format"
            ) from None

    def _items(self) -> Iterator[Item]:
        fmt = self.file.fmt
        if fmt == "parquet":
            yield from self._parquet()
        elif fmt == "arrow":
            yield from self._arrow()
        elif fmt == "csv":
            yield from self._csv()
        else:
            with open_binary(self.file.path, self.file.compression) as (stream, self._probe):
                if fmt == "txt":
                    yield from self._txt(stream)
                elif fmt == "json" and _starts_with_bracket(stream):
                    yield from _json_array(stream)
                else:
                    yield from _jsonl(stream)
        self._probe = lambda: self.file.size

    def _txt(self, stream: BinaryIO) -> Iterator[Item]:
        if self.doc_per_file:
            yield 1, TEXT_LINE, stream.read().removeprefix(BOM)
            return
        for n, line in enumerate(stream, 1):
            yield n, TEXT_LINE, (line.removeprefix(BOM) if n == 1 else line).rstrip(b"\r\n")

    def _parquet(self) -> Iterator[Item]:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.file.path)
        cols = self._present(pf.schema_arrow.names)
        groups = max(pf.num_row_groups, 1)
        row = 0
        for g in range(pf.num_row_groups):
            for batch in pf.iter_batches(batch_size=2048, row_groups=[g], columns=cols):
                for rec in batch.to_pylist():
                    row += 1
                    yield row, RECORD, rec
            done = (g + 1) * self.file.size // groups
            self._probe = lambda done=done: done

    def _arrow(self) -> Iterator[Item]:
        import pyarrow as pa
        import pyarrow.ipc as ipc

        row = 0
        source = pa.memory_map(self.file.path)
        try:
            reader = ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            total = max(reader.num_record_batches, 1)
        except pa.ArrowInvalid:
            source.seek(0)
            reader = ipc.open_stream(source)
            batches, total = iter(reader), 0
        for i, batch in enumerate(batches, 1):
            cols = self._present(batch.schema.names)
            if cols is not None:
                batch = batch.select(cols)
            for rec in batch.to_pylist():
                row += 1
                yield row, RECORD, rec
            if total:
                done = i * self.file.size // total
            else:
                done = source.tell()
            self._probe = lambda done=done: done

    def _csv(self) -> Iterator[Item]:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        # Read text columns as binary so one row of invalid UTF-8 is skipped, not the file.
        header = _csv_header(self.file)
        stream = pa.input_stream(self.file.path, compression=self.file.compression)
        types = {name: pa.binary() for name in header}
        reader = pcsv.open_csv(
            stream,
            read_options=pcsv.ReadOptions(block_size=1 << 20),
            convert_options=pcsv.ConvertOptions(
                column_types=types, include_columns=self._present(header), strings_can_be_null=False
            ),
        )
        row = 1  # the header is line 1
        for batch in reader:
            for rec in batch.to_pylist():
                row += 1
                try:
                    out = {
                        k: (v.decode("utf-8") if isinstance(v, bytes) else v)
                        for k, v in rec.items()
                    }
                except UnicodeDecodeError as exc:
                    yield row, ERROR, RecordError("invalid UTF-8", str(exc))
                    continue
                yield row, RECORD, out
            pos = stream.tell()
            self._probe = lambda pos=pos: pos
        stream.close()

    def _present(self, names: list[str]) -> list[str] | None:
        """Columns to read: the wanted ones that exist (missing keys are reported per record)."""
        if self.columns is None:
            return None
        return [c for c in self.columns if c in names]


def _csv_header(f: InputFile) -> list[str]:
    """Read and split the first CSV line (used to force text columns to binary)."""
    import csv

    with open_binary(f.path, f.compression) as (stream, _):
        first = stream.readline().removeprefix(BOM)
    rows = list(csv.reader([first.decode("utf-8", "replace").rstrip("\r\n")]))
    return rows[0] if rows else []


def _starts_with_bracket(stream: BinaryIO) -> bool:
    """True when a .json file holds one top-level array rather than JSON lines."""
    head = stream.peek(4096) if hasattr(stream, "peek") else b""  # type: ignore[attr-defined]
    return head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"["


def _jsonl(stream: BinaryIO) -> Iterator[Item]:
    """One raw JSON line per item; blank lines (e.g. a trailing one) are not records."""
    for n, line in enumerate(stream, 1):
        if n == 1:
            line = line.removeprefix(BOM)  # a byte-order mark is not part of the first record
        if line.strip():
            yield n, JSON_LINE, line


def _json_array(stream: BinaryIO, chunk: int = 1 << 20) -> Iterator[Item]:
    """Yield the elements of a top-level JSON array without loading the file into memory."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")("strict")
    buf, pos, line, eof = "", 0, 1, False

    def more(size: int) -> bool:
        nonlocal buf, pos, eof
        data = stream.read(size)
        eof = not data
        buf = buf[pos:] + utf8.decode(data, final=eof)
        pos = 0
        return not eof

    def skip(chars: str) -> None:
        nonlocal pos, line
        while True:
            while pos < len(buf) and buf[pos] in chars:
                line += buf[pos] == "\n"
                pos += 1
            if pos < len(buf) or not more(chunk):
                return

    try:
        skip("\ufeff \t\r\n")
        pos += 1  # the opening bracket
        size = chunk
        while True:
            skip(" \t\r\n,")
            if pos >= len(buf) or buf[pos] == "]":
                return
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as exc:
                if not eof and more(size):
                    size *= 2
                    continue
                yield line, ERROR, RecordError("malformed JSON", f"{exc.msg}; rest of file skipped")
                return
            size = chunk
            if _SURROGATE_ESCAPE.search(buf, pos, end) and _lone_surrogate(value):
                yield line, ERROR, RecordError("invalid Unicode", "a lone surrogate escape")
            else:
                yield line, RECORD, value
            line += buf.count("\n", pos, end)
            pos = end
    except UnicodeDecodeError as exc:
        yield line, ERROR, RecordError("invalid UTF-8", f"{exc.reason}; rest of file skipped")


def decode_item(kind: str, payload: Any, text_key: str) -> dict:
    """Turn one reader payload into a record dict, raising RecordError when unusable."""
    if kind == RECORD:
        if not isinstance(payload, dict):
            raise RecordError("not a JSON object", type(payload).__name__)
        return payload
    if kind == ERROR:
        raise payload
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError("invalid UTF-8", f"byte {exc.start}") from None
    if kind == TEXT_LINE:
        return {text_key: text}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError("malformed JSON", exc.msg) from None
    if _SURROGATE_ESCAPE.search(text) and _lone_surrogate(value):
        raise RecordError("invalid Unicode", "a lone surrogate escape")
    if not isinstance(value, dict):
        raise RecordError("not a JSON object", type(value).__name__)
    return value


def _lone_surrogate(value: Any) -> bool:
    """True when a decoded JSON value holds a string no tokenizer can encode (``"\\ud800"``)."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_lone_surrogate(v) for v in value)
    return False
