"""Files from elsewhere: damaged inputs, hostile ``.idx``/``.bin`` pairs, runs that write
nothing, and what a killed run leaves behind. Each bad file is one line, never a traceback."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from anyspeed.data.writer import IndexedWriter, IndexFileError, check_dataset
from helpers.corpora import files_bytes, leftovers, read_back, run_cli, write_jsonl

DOCS = [f"record {i} says {i * 7919 % 1000} things" for i in range(3000)]  # fast to tokenize
PLAIN = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in DOCS).encode()


def _preprocess(capsys, hf_tok: str, src: str, prefix: str, *flags: str) -> tuple[int, str]:
    argv = ["preprocess", "--input", src, "--output-prefix", prefix, "--quiet",
            "--tokenizer-name-or-path", hf_tok, *flags]  # fmt: skip
    return run_cli(capsys, *argv)


def _one_line_error(rc: int, err: str, code: int) -> str:
    assert rc == code, err
    assert err.startswith("anyspeed: error: ") and err.count("\n") == 1, err
    return err


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def _parquet_bytes(tmp_path) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS[:50]}), str(tmp_path / "p.parquet"))
    return (tmp_path / "p.parquet").read_bytes()


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


# name, file name, bytes (from tmp_path) - each was a traceback or, for the cut .zst, a silent
# partial dataset (exit 0, 1313 of 3000 documents)
DAMAGED = [
    ("gz-truncated", "in.jsonl.gz", lambda t: _half(gzip.compress(PLAIN))),
    ("gz-not-gzip", "in.jsonl.gz", lambda t: PLAIN[:4000]),
    ("zst-cut-in-half", "in.jsonl.zst", lambda t: _half(_zstd(PLAIN))),
    ("zst-cut-at-the-end", "in.jsonl.zst", lambda t: _zstd(PLAIN)[:-1]),
    ("zst-garbage", "in.jsonl.zst", lambda t: b"not zstd at all " * 64),
    ("parquet-garbage", "in.parquet", lambda t: b"PAR1" + b"garbage" * 99 + b"PAR1"),
    ("parquet-truncated", "in.parquet", lambda t: _parquet_bytes(t)[:-40]),
    ("csv-gz-truncated", "in.csv.gz", lambda t: gzip.compress(b"text\n" + b"row\n" * 9000)[:300]),
]


@pytest.mark.parametrize("case", DAMAGED, ids=[c[0] for c in DAMAGED])
def test_damaged_input_file_is_one_line_and_writes_nothing(case, tmp_path, capsys, hf_tok):
    _, name, make = case
    src = tmp_path / name
    src.write_bytes(make(tmp_path))
    rc, err = _preprocess(capsys, hf_tok, str(src), str(tmp_path / "o"))
    err = _one_line_error(rc, err, 1)
    assert f"{src}: cannot read this" in err
    assert [f for f in leftovers(str(tmp_path)) if f.startswith("o")] == []


def test_every_zstd_frame_is_read(tmp_path, capsys, hf_tok):
    """Concatenated frames (pzstd, appended files) are one stream, as the zstd tool reads them."""
    cut = PLAIN.index(b"\n", len(PLAIN) // 3) + 1
    (tmp_path / "in.jsonl.zst").write_bytes(_zstd(PLAIN[:cut]) + _zstd(PLAIN[cut:]))
    (tmp_path / "in.jsonl").write_bytes(PLAIN)
    for name in ("in.jsonl.zst", "in.jsonl"):
        rc, err = _preprocess(capsys, hf_tok, str(tmp_path / name), str(tmp_path / name))
        assert rc == 0, err
    got = read_back(str(tmp_path / "in.jsonl.zst_text_document"))
    assert len(got) == len(DOCS) and got == read_back(str(tmp_path / "in.jsonl_text_document"))


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_lone_surrogate_is_a_skipped_record(fmt, tmp_path, capsys, hf_tok, auto_tok):
    records = [
        '{"text": "first"}',
        '{"text": "bad \\ud800 here"}',
        '{"text": "last \\ud83d\\ude00"}',
    ]
    body = "\n".join(records) if fmt == "jsonl" else "[" + ",\n".join(records) + "]"
    src = tmp_path / f"in.{fmt}"
    src.write_text(body + "\n")
    prefix = str(tmp_path / "o")
    rc, err = run_cli(capsys, "preprocess", "--input", str(src), "--output-prefix", prefix,
                      "--tokenizer-name-or-path", hf_tok)  # fmt: skip
    assert rc == 0, err
    assert f"{src}:2: invalid Unicode" in err and "skipped 1" in err
    want = [auto_tok(t)["input_ids"] for t in ("first", "last \U0001f600")]
    assert read_back(prefix + "_text_document") == want
    rc, err = _preprocess(capsys, hf_tok, str(src), str(tmp_path / "s"), "--strict")
    assert f"{src}:2: invalid Unicode" in _one_line_error(rc, err, 1)


@pytest.mark.parametrize("name", ["in.jsonl", "in.txt", "in.csv"])
def test_byte_order_mark_keeps_the_first_record(name, tmp_path, capsys, hf_tok, auto_tok):
    body = {"in.jsonl": '{"text": "first"}\n{"text": "second"}\n',
            "in.txt": "first\nsecond\n", "in.csv": "text\nfirst\nsecond\n"}[name]  # fmt: skip
    src = tmp_path / name
    src.write_bytes(b"\xef\xbb\xbf" + body.encode())
    rc, err = _preprocess(capsys, hf_tok, str(src), str(tmp_path / "o"))
    assert rc == 0, err
    want = [auto_tok(t)["input_ids"] for t in ("first", "second")]
    assert read_back(str(tmp_path / "o_text_document")) == want


NOTHING = [
    ("empty-input", b"", [], "holds no records"),
    ("all-skipped", b'{"text": ""}\n{"body": "x"}\n', [], "records were skipped"),
    ("json-keys-name-no-field", PLAIN[:2000], ["--json-keys", "nope"], "missing key"),
]


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("case", NOTHING, ids=[c[0] for c in NOTHING])
def test_nothing_written_is_an_error_and_keeps_the_old_output(
    case, partitions, tmp_path, capsys, hf_tok
):
    _, data, flags, message = case
    prefix = str(tmp_path / "o")
    good = write_jsonl(str(tmp_path / "good.jsonl"), [{"text": d} for d in DOCS[:20]])
    assert _preprocess(capsys, hf_tok, good, prefix)[0] == 0
    before = files_bytes(prefix + "_text_document")
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(partitions):  # --partitions needs as many files
        (inputs / f"{i}.jsonl").write_bytes(data)
    runs = ["--partitions", str(partitions), "--workers", str(partitions)]
    rc, err = _preprocess(capsys, hf_tok, str(inputs), prefix, "--overwrite", *runs, *flags)
    assert message in _one_line_error(rc, err, 1)
    assert files_bytes(prefix + "_text_document") == before
    assert leftovers(str(tmp_path)) == ["good.jsonl", "in", "o_text_document.bin",
                                        "o_text_document.idx"]  # fmt: skip


@pytest.mark.parametrize("case", ["empty", "no-such-key", "damaged"])
def test_train_tokenizer_refuses_an_unusable_corpus(case, tmp_path, capsys):
    src = tmp_path / ("in.jsonl.gz" if case == "damaged" else "in.jsonl")
    src.write_bytes({"empty": b"", "no-such-key": PLAIN[:3000],
                     "damaged": gzip.compress(PLAIN)[:500]}[case])  # fmt: skip
    out = tmp_path / "tok" / "sub"
    keys = ["--json-keys", "body"] if case == "no-such-key" else []
    rc, err = run_cli(capsys, "train-tokenizer", "--input", str(src), "--vocab-size", "512",
                      "--output-dir", str(out), *keys)  # fmt: skip
    err = _one_line_error(rc, err, 1)
    assert (str(src) if case == "damaged" else "no usable text") in err
    assert not (tmp_path / "tok").exists()  # not even an empty directory


def test_train_tokenizer_skips_a_lone_surrogate(tmp_path, capsys):
    """One ``"\\ud800"`` record used to abort the whole run (UnicodeEncodeError)."""
    src = tmp_path / "in.jsonl"
    lines = PLAIN.splitlines(keepends=True)
    src.write_bytes(
        b"".join(lines[:100]) + b'{"text": "bad \\ud800 here"}\n' + b"".join(lines[100:200])
    )
    out = tmp_path / "tok"
    rc, err = run_cli(capsys, "train-tokenizer", "--input", str(src), "--vocab-size", "300",
                      "--output-dir", str(out))  # fmt: skip
    assert rc == 0, err
    assert (out / "tokenizer.json").is_file()


def test_stale_temp_files_of_a_killed_run_are_removed(tmp_path, capsys, hf_tok, auto_tok):
    dead = subprocess.Popen(["true"])
    dead.wait()
    d, live = dead.pid, os.getppid()
    base = tmp_path / "o_text_document"
    stale = [
        f".bin.tmp-{d}",
        f".idx.tmp-{d}",
        f".lengths.tmp-{d}",
        f".docs.tmp-{d}",
        f".part000.tmp-{d}.bin",
        f".part001.tmp-{d}.idx",
        f".part000.tmp-{d}.bin.tmp-{d}",
    ]
    kept = [f".bin.tmp-{live}", f".part000.tmp-{live}.bin", f".part000.tmp-{d}.bin.tmp-{live}",
            ".bin.tmp-old", f".bin.tmp-{d}.bak", f".binx.tmp-{d}"]  # fmt: skip
    for suffix in stale + kept:
        (tmp_path / f"o_text_document{suffix}").write_bytes(b"x")
    src = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": "one"}, {"text": "two"}])
    rc, err = _preprocess(capsys, hf_tok, src, str(tmp_path / "o"))
    assert rc == 0, err
    want = sorted(["in.jsonl", "o_text_document.bin", "o_text_document.idx"]
                  + [base.name + s for s in kept])  # fmt: skip
    assert leftovers(str(tmp_path)) == want
    assert read_back(str(base)) == [auto_tok(t)["input_ids"] for t in ("one", "two")]


def _dead(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (it holds no files and runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_signalled_parent_stops_partition_workers_and_their_files(sig, tmp_path, hf_tok):
    """A signal to ``preprocess --partitions``: after SIGKILL its workers used to finish their
    groups and leave complete-looking ``part*.tmp-PID.bin/.idx`` files; now they stop and
    remove them (SIGTERM: the parent stops them and removes them)."""
    (tmp_path / "in").mkdir()
    for i in range(2):  # seconds of work each, in short records (a worker stops between two)
        lines = (f'{{"text": "short document number {n}"}}\n' for n in range(100_000))
        (tmp_path / "in" / f"{i}.jsonl").write_text("".join(lines))
    (tmp_path / "out").mkdir()
    cmd = [sys.executable, "-m", "anyspeed.cli", "preprocess", "--input",
           str(tmp_path / "in"), "--output-prefix", str(tmp_path / "out" / "o"), "--quiet",
           "--partitions", "2", "--workers", "2",
           "--tokenizer-name-or-path", os.path.join(hf_tok, "tokenizer.json")]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    workers: set[int] = set()
    while len(workers) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "run ended too early"
        names = [n for n in leftovers(str(tmp_path / "out")) if ".bin.tmp-" in n]
        workers = {int(n.rsplit("-", 1)[1]) for n in names}
        time.sleep(0.01)
    proc.send_signal(getattr(signal, sig))
    assert proc.wait(timeout=30) == (-signal.SIGKILL if sig == "SIGKILL" else 130)
    while not all(_dead(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their parent"
        time.sleep(0.05)
    assert leftovers(str(tmp_path / "out")) == []


# --- .idx / .bin ---------------------------------------------------------------------------


def _dataset(prefix: str, lengths: list[int], seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    writer = IndexedWriter(prefix, np.uint16)
    writer.add(rng.integers(0, 500, sum(lengths)), np.array(lengths))
    writer.finish()
    return prefix


def _pretrain_error(capsys, prefix: str) -> str:
    from anyspeed.commands.train import pretrain as main

    argv = ["--model", "tiny-qwen2.5", "--num-layers", "2", "--padded-vocab-size", "512",
            "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-3", "--data-path", prefix,
            "--split", "1,0,0"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("anyspeed pretrain: error: "), err
    return err


def test_bin_and_idx_that_do_not_match_are_refused_before_start(tmp_path, capsys):
    a = _dataset(str(tmp_path / "a"), [5, 9, 3, 7])
    other = _dataset(str(tmp_path / "other"), [4, 4, 12, 2, 2, 6])
    good = files_bytes(a)
    cases = {
        "truncated .bin": (good[0][:-2], good[1]),
        ".idx of another dataset": (good[0], files_bytes(other)[1]),
        ".bin larger than its .idx": (good[0] + b"\0\0" * 3, good[1]),
    }
    for name, (bin_bytes, idx_bytes) in cases.items():
        (tmp_path / "a.bin").write_bytes(bin_bytes)
        (tmp_path / "a.idx").write_bytes(idx_bytes)
        err = _pretrain_error(capsys, a)
        assert f"--data-path {a!r}" in err and "belong to different datasets" in err, (name, err)


def test_index_reader_matches_megatron(tmp_path):
    from megatron.core.datasets.indexed_dataset import _IndexReader

    prefix = _dataset(str(tmp_path / "d"), [5, 1, 9, 3, 7, 2])
    ours, theirs = check_dataset(prefix), _IndexReader(prefix + ".idx", multimodal=False)
    assert ours.dtype == theirs.dtype and ours.tokens == int(theirs.sequence_lengths.sum())
    assert np.array_equal(ours.lengths, theirs.sequence_lengths)
    assert np.array_equal(ours.documents, theirs.document_indices)


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0:  # a few random bytes anywhere
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:
        del b[rng.randrange(len(b)) :]
    elif kind == 2:
        b += rng.randbytes(rng.randint(1, 24))
    elif kind == 3:  # a header count: huge, negative as signed, or off by a little
        at = rng.choice([18, 26])
        old = int.from_bytes(b[at : at + 8], "little")
        new = rng.choice([rng.getrandbits(64), (1 << 64) - 1, old + rng.randint(-3, 3)])
        b[at : at + 8] = (new % (1 << 64)).to_bytes(8, "little")
    elif kind == 4:  # one aligned entry (a length, pointer or document index) replaced
        at = 34 + rng.randrange((len(b) - 34) // 4) * 4
        b[at : at + 4] = rng.getrandbits(32).to_bytes(4, "little")
    else:  # the version or dtype code
        at = rng.choice([9, 17])
        b[at] = rng.randrange(256)
    return bytes(b)


def test_idx_fuzz_never_reads_outside_the_file(tmp_path, monkeypatch):
    """Random mutations of a valid ``.idx``: each is accepted (and then consistent with its
    ``.bin``) or one IndexFileError line; no other exception, no map beyond the file's end."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    lengths = [3, 0, 17, 5, 1, 30, 2, 9]
    src = _dataset(str(tmp_path / "src"), lengths)
    bin_bytes, idx_bytes = files_bytes(src)
    real_memmap = np.memmap

    def checked(path, dtype=np.uint8, mode="r+", offset=0, shape=None, order="C"):  # noqa: ANN001, ANN202
        if shape is not None:
            end = offset + int(np.prod(shape)) * np.dtype(dtype).itemsize
            assert end <= os.path.getsize(path), f"map of {path} ends past the file"
        return real_memmap(path, dtype, mode, offset, shape, order)

    monkeypatch.setattr(np, "memmap", checked)
    prefix = str(tmp_path / "m")
    shutil.copy(src + ".bin", prefix + ".bin")
    rng = random.Random(19)
    outcomes = {"accepted": 0, "refused": 0}
    for _ in range(400):
        idx = _mutate(rng, idx_bytes)
        with open(prefix + ".idx", "wb") as fh:
            fh.write(idx)
        try:
            index = check_dataset(prefix)
        except IndexFileError as exc:
            assert "\n" not in str(exc) and prefix in str(exc)
            outcomes["refused"] += 1
            continue
        outcomes["accepted"] += 1  # then Megatron's own reader finds every sequence in the .bin
        assert index.bin_bytes == len(bin_bytes) and index.documents[-1] == len(index.lengths)
        theirs = _IndexReader(prefix + ".idx", multimodal=False)
        ends = theirs.sequence_pointers + theirs.sequence_lengths * np.dtype(theirs.dtype).itemsize
        assert ends.max(initial=0) <= len(bin_bytes)
        assert int(theirs.document_indices[-1]) == len(theirs.sequence_lengths)
    assert outcomes["refused"] > 250, outcomes
