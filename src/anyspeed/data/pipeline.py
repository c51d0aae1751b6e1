"""The preprocessing run: validate, stream chunks through workers in order, write, merge."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from anyspeed.data.errors import DataError, RecordError, UsageError
from anyspeed.data.handlers import Handler, Sample
from anyspeed.data.packing import Packer
from anyspeed.data.progress import Progress, Stats
from anyspeed.data.readers import InputFile, Item, Reader, decode_item, resolve_inputs
from anyspeed.data.registry import PAIRWISE_HANDLERS, RL_HANDLERS, build_handler
from anyspeed.data.tokenizer import Tokenizer, TokenizerSpec, load_tokenizer
from anyspeed.data.workers import init_worker, mp_context, stop_pool
from anyspeed.data.writer import (
    IndexedWriter,
    dataset_paths,
    remove_stale_temp_files,
    remove_temp_files,
)


@dataclass
class Config:
    """Everything ``anyspeed preprocess`` takes from its command line."""

    input: str
    output_prefix: str
    tokenizer: TokenizerSpec
    handler_name: str = "GeneralPretrainHandler"
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    append_eod: bool = False
    map_keys: str | None = None
    prompt_type: str | None = None
    seq_length: int | None = None
    pack: bool = False
    neat_pack: bool = False
    pack_window: int = 10000
    workers: int = 1
    partitions: int = 1
    input_format: str | None = None
    txt_doc_per_file: bool = False
    strict: bool = False
    overwrite: bool = False
    progress: bool = True
    chunk_docs: int = 512
    chunk_bytes: int = 4 << 20
    placeholder_token: str | None = None
    reward_tokens: list[str] | None = None


@dataclass
class Job:
    """A picklable unit of work: some files into some output prefixes."""

    files: list[InputFile]
    prefixes: dict[str, str]
    dtypes: dict[str, Any]
    spec: TokenizerSpec
    handler: Handler
    cfg: Config
    workers: int
    progress: bool
    pad_id: int | None = None
    allow_empty: bool = False  # a partition may be empty; the run as a whole may not


@dataclass
class ChunkResult:
    """What a worker returns for one chunk: per-key arrays, lengths and skipped records."""

    source: str
    records: int
    data: dict[str, tuple[np.ndarray, np.ndarray]]
    errors: list[tuple[int, str, str]]
    position: int = 0


# --- worker side ---------------------------------------------------------------------------

_STATE: dict[str, Any] = {}


def _set_state(spec: TokenizerSpec, handler: Handler, text_key: str, dtypes: dict) -> None:
    """Install the tokenizer/handler a chunk is processed with (reused when unchanged)."""
    if _STATE.get("spec") != spec:
        _STATE["tok"] = load_tokenizer(spec)
        _STATE["spec"] = spec
    _STATE.update(handler=handler, text_key=text_key, dtypes=dtypes)


def _init_worker(
    parent: int, spec: TokenizerSpec, handler: Handler, text_key: str, dtypes: dict
) -> None:
    init_worker(parent)
    _set_state(spec, handler, text_key, dtypes)


def _process(chunk: tuple[str, list[Item], int]) -> ChunkResult:
    """Decode, tokenize and pack one chunk of records into contiguous arrays."""
    source, items, position = chunk
    handler: Handler = _STATE["handler"]
    errors: list[tuple[int, str, str]] = []
    lines, records = [], []
    for line, kind, payload in items:
        try:
            records.append(decode_item(kind, payload, _STATE["text_key"]))
            lines.append(line)
        except RecordError as exc:
            errors.append((line, exc.reason, exc.detail))
    samples: list[Sample] = []
    for line, out in zip(lines, handler.process(records, _STATE["tok"]), strict=True):
        if isinstance(out, RecordError):
            errors.append((line, out.reason, out.detail))
        else:
            samples.append(out)
    errors.sort()
    data = {}
    for key, dtype in _STATE["dtypes"].items():
        arrays = [s[key] for s in samples]
        lengths = np.fromiter((len(a) for a in arrays), np.int32, len(arrays))
        flat = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)
        data[key] = (flat, lengths)
    return ChunkResult(source, len(items), data, errors, position)


# --- main side -----------------------------------------------------------------------------


def output_prefixes(cfg: Config, handler: Handler) -> dict[str, str]:
    """Per-key dataset prefixes (MindSpeed-LLM naming: ``_packed_`` for instruction data)."""
    mid = "packed_" if handler.instruction else ""
    return {k: f"{cfg.output_prefix}_{mid}{k}_document" for k in handler.keys}


def _check_output(prefixes: dict[str, str], overwrite: bool) -> None:
    directory = os.path.dirname(os.path.abspath(next(iter(prefixes.values()))))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".anyspeed-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise UsageError(
            f"output directory {directory!r} is not writable: {exc.strerror}"
        ) from None
    for prefix in prefixes.values():
        for path in dataset_paths(prefix):
            if os.path.exists(path) and not overwrite:
                raise UsageError(f"output {path!r} exists; pass --overwrite to replace it")


def prepare(cfg: Config) -> tuple[Job, Tokenizer]:
    """Validate every flag and path before any work starts; raises UsageError."""
    if cfg.workers < 1 or cfg.partitions < 1:
        raise UsageError("--workers and --partitions must be at least 1")
    if cfg.seq_length is not None and cfg.seq_length < 1:
        raise UsageError("--seq-length must be positive")
    if (cfg.pack or cfg.neat_pack) and cfg.handler_name in PAIRWISE_HANDLERS:
        raise UsageError("pairwise data is not packed; drop --pack")
    if (cfg.pack or cfg.neat_pack) and cfg.handler_name in RL_HANDLERS:
        raise UsageError("prompts for reinforcement learning are not packed; drop --pack")
    cfg.tokenizer.check()
    files = resolve_inputs(cfg.input, cfg.input_format)
    tok = load_tokenizer(cfg.tokenizer)
    handler = build_handler(
        cfg.handler_name,
        tok,
        cfg.json_keys,
        cfg.append_eod,
        cfg.map_keys,
        cfg.prompt_type,
        cfg.seq_length,
        cfg.placeholder_token,
        cfg.reward_tokens,
    )
    if cfg.pack and not handler.instruction:
        raise UsageError("--pack applies to instruction handlers; pretraining data is not packed")
    if cfg.pack and cfg.seq_length is None:
        raise UsageError("--pack needs --seq-length")
    if cfg.neat_pack and not cfg.pack:
        raise UsageError("--neat-pack needs --pack")
    if cfg.pack and tok.pad_id is None:
        raise UsageError("--pack: the tokenizer has neither a pad nor an end-of-document token")
    dtypes = handler.dtypes(tok.vocab_size)
    if cfg.neat_pack:
        dtypes["attention_mask"] = np.int32
    prefixes = output_prefixes(cfg, handler)
    _check_output(prefixes, cfg.overwrite)
    for prefix in prefixes.values():
        removed = remove_stale_temp_files(prefix)
        if removed and cfg.progress:
            name = os.path.basename(removed[0])
            print(
                f"anyspeed preprocess: removed {len(removed)} temporary files of an "
                f"interrupted run ({name}, ...)",
                file=sys.stderr,
            )
    pad = tok.pad_id if tok.pad_id is not None else tok.eod_id
    job = Job(files, prefixes, dtypes, cfg.tokenizer, handler, cfg, cfg.workers, cfg.progress, pad)
    return job, tok


def _chunks(job: Job, stats: Stats) -> Iterator[tuple[str, list[Item], int]]:
    """Read every file in order and cut the record stream into bounded chunks."""
    cfg = job.cfg
    done = 0
    for f in job.files:
        reader = Reader(f, job.handler.columns(), cfg.txt_doc_per_file)
        items: list[Item] = []
        size = 0
        for item in reader:
            items.append(item)
            size += len(item[2]) if isinstance(item[2], bytes) else 64
            if len(items) >= cfg.chunk_docs or size >= cfg.chunk_bytes:
                yield f.path, items, done + reader.position()
                items, size = [], 0
        if items:
            yield f.path, items, done + f.size
        done += f.size
    stats.input_bytes = done


@contextlib.contextmanager
def tokenizers_single_threaded() -> Iterator[None]:
    """Each worker encodes on one thread, so ``--workers`` is the real CPU budget."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = old if old is not None else "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


def _results(job: Job, chunks: Iterator) -> Iterator[ChunkResult]:
    """Process chunks in-process or on a pool, yielding results in input order."""
    text_key = job.handler.keys[0]
    _set_state(job.spec, job.handler, text_key, job.dtypes)
    if job.workers == 1:
        yield from map(_process, chunks)
        return
    pool = mp_context().Pool(
        job.workers,
        initializer=_init_worker,
        initargs=(os.getpid(), job.spec, job.handler, text_key, job.dtypes),
    )
    try:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_process, (chunk,)))
            if len(pending) >= 2 * job.workers + 2:  # bounded: memory does not grow with input
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        stop_pool(pool)


def check_written(stats: Stats, cfg: Config) -> None:
    """Zero samples written is an error (raised before any output is renamed into place)."""
    if stats.samples:
        return
    if not stats.records:
        raise DataError(f"--input {cfg.input!r} holds no records; nothing was written")
    why = ", ".join(f"{reason}: {n}" for reason, n in stats.skipped.most_common())
    first = f"; first: {stats.examples[0]}" if stats.examples else ""
    raise DataError(
        f"all {stats.records} records were skipped ({why}){first}; nothing was written and "
        "existing outputs are kept - check --json-keys, --handler-name or the input"
    )


def run_job(job: Job) -> Stats:
    """Stream ``job.files`` into ``job.prefixes``; temp files are removed on any failure."""
    cfg = job.cfg
    stats = Stats()
    start = time.monotonic()
    progress = Progress(sum(f.size for f in job.files), enabled=job.progress)
    writers: dict[str, IndexedWriter] = {}
    packer = None
    if cfg.pack:
        assert cfg.seq_length is not None and job.pad_id is not None
        packer = Packer(cfg.seq_length, cfg.pack_window, job.pad_id, cfg.neat_pack)
    try:
        for key, prefix in job.prefixes.items():
            writers[key] = IndexedWriter(prefix, job.dtypes[key])
        first = job.handler.keys[0]
        # closing(): the pool stops now on an error, not whenever the generator is collected
        # (perhaps in a process forked later, which would then wait on the old pool's locks)
        with (
            tokenizers_single_threaded(),
            contextlib.closing(_results(job, _chunks(job, stats))) as results,
        ):
            for res in results:
                stats.records += res.records
                for line, reason, detail in res.errors:
                    msg = stats.skip(res.source, line, reason, detail)
                    if cfg.strict:
                        raise DataError(f"{msg} (--strict)")
                stats.samples += len(res.data[first][1])
                if packer is None:
                    stats.tokens += len(res.data[first][0])
                    for key, (flat, lengths) in res.data.items():
                        writers[key].add(flat, lengths)
                else:
                    _write_packs(packer.add(_split(res.data)), writers, stats)
                progress.update(stats, res.position)
        if packer is not None:
            _write_packs(packer.flush(), writers, stats)
        if not job.allow_empty:
            check_written(stats, cfg)
        progress.update(stats, stats.input_bytes, force=True)
        progress.close()
        for w in writers.values():
            bin_path, idx_path = w.finish()
            stats.outputs[bin_path] = os.path.getsize(bin_path)
            stats.outputs[idx_path] = os.path.getsize(idx_path)
    except BaseException:
        progress.close()
        for w in writers.values():
            w.abort()
        for prefix in job.prefixes.values():  # a writer interrupted before it was recorded
            remove_temp_files(prefix)
        raise
    stats.seconds = time.monotonic() - start
    return stats


def _split(data: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[Sample]:
    """Per-sample arrays from a chunk's concatenated arrays."""
    keys = list(data)
    cuts = np.cumsum(data[keys[0]][1])[:-1]
    parts = {k: np.split(data[k][0].astype(np.int64), cuts) for k in keys}
    n = len(data[keys[0]][1])
    return [{k: parts[k][i] for k in keys} for i in range(n)]


def _write_packs(packs: list[Sample], writers: dict[str, IndexedWriter], stats: Stats) -> None:
    if not packs:
        return
    stats.packs += len(packs)
    stats.tokens += sum(int(np.count_nonzero(p["attention_mask"])) for p in packs)
    for key in writers:
        arrays = [p[key] for p in packs]
        writers[key].add(np.concatenate(arrays), np.array([len(a) for a in arrays], np.int32))
