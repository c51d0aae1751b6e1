"""Bad input is reported with file:line and skipped (or fatal with --strict); bad setup exits 2."""

from __future__ import annotations

import os

import pytest

from helpers.corpora import (
    leftovers,
    read_back,
    run_cli,
    write_jsonl,
)

GOOD = ['{"text": "first good document"}', '{"text": "second good document"}']

# (name, file name, file bytes, line of the bad record, reason in the report)
CASES = [
    (
        "malformed-json",
        "in.jsonl",
        b'{"text": "a"}\n{"text": broken\n{"text": "b"}\n',
        2,
        "malformed JSON",
    ),
    ("missing-key", "in.jsonl", b'{"text": "a"}\n{"body": "x"}\n{"text": "b"}\n', 2, "missing key"),
    (
        "empty-doc",
        "in.jsonl",
        b'{"text": "a"}\n{"text": "b"}\n{"text": "  "}\n',
        3,
        "empty document",
    ),
    (
        "bad-utf8",
        "in.jsonl",
        b'{"text": "a"}\n{"text": "\xff\xfe"}\n{"text": "b"}\n',
        2,
        "invalid UTF-8",
    ),
    ("not-object", "in.jsonl", b'[1, 2]\n{"text": "a"}\n{"text": "b"}\n', 1, "not a JSON object"),
    ("txt-utf8", "in.txt", b"a\n\xc3\x28 bad\nb\n", 2, "invalid UTF-8"),
    ("csv-utf8", "in.csv", b'id,text\n1,a\n2,"\xff bad"\n3,b\n', 3, "invalid UTF-8"),
    ("csv-empty", "in.csv", b"id,text\n1,a\n2,\n3,b\n", 3, "empty document"),
    (
        "array-malformed",
        "in.json",
        b'[{"text": "a"},\n {"text": "b"},\n {"text": }]',
        3,
        "malformed JSON",
    ),
]


def _prefix_files(tmp_path) -> list[str]:
    return [f for f in leftovers(str(tmp_path)) if f.startswith("o")]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_record_is_reported_and_skipped(case, tmp_path, capsys, hf_tok, auto_tok):
    _, name, data, line, reason = case
    src = tmp_path / name
    src.write_bytes(data)
    prefix = str(tmp_path / "o")
    argv = ["preprocess", "--input", str(src), "--output-prefix", prefix,
            "--tokenizer-name-or-path", hf_tok]  # fmt: skip
    rc, err = run_cli(capsys, *argv)
    assert rc == 0, err
    assert f"{src}:{line}: {reason}" in err
    assert "skipped 1" in err
    assert read_back(prefix + "_text_document") == [auto_tok(t)["input_ids"] for t in ("a", "b")]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_strict_fails_at_first_bad_record_and_writes_nothing(case, tmp_path, capsys, hf_tok):
    _, name, data, line, reason = case
    src = tmp_path / name
    src.write_bytes(data)
    argv = ["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-name-or-path", hf_tok, "--strict", "--workers", "2"]  # fmt: skip
    rc, err = run_cli(capsys, *argv)
    assert rc == 1
    assert f"anyspeed: error: {src}:{line}: {reason}" in err
    assert _prefix_files(tmp_path) == []  # neither final nor temporary files


def test_strict_failure_late_in_a_large_run_leaves_no_temp_files(tmp_path, capsys, hf_tok):
    lines = [f'{{"text": "document number {i}"}}' for i in range(3000)] + ["{oops"]
    src = tmp_path / "big.jsonl"
    src.write_text("\n".join(lines) + "\n")
    argv = ["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-name-or-path", hf_tok, "--strict", "--chunk-docs", "100"]  # fmt: skip
    rc, err = run_cli(capsys, *argv)
    assert rc == 1 and f"{src}:3001: malformed JSON" in err
    assert _prefix_files(tmp_path) == []


def _usage(capsys, tmp_path, hf_tok, *flags, src=None) -> str:
    if src is None:
        src = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": "a"}])
    base = {"--input": src, "--output-prefix": str(tmp_path / "o"),
            "--tokenizer-name-or-path": hf_tok}  # fmt: skip
    args = list(flags)
    for k, v in base.items():
        if k not in args:
            args += [k, v]
    rc, err = run_cli(capsys, "preprocess", *args)
    assert rc == 2
    assert err.startswith("anyspeed: error: ") and err.count("\n") == 1, err
    assert _prefix_files(tmp_path) == []
    return err


def test_missing_tokenizer_path(tmp_path, capsys, hf_tok):
    err = _usage(capsys, tmp_path, hf_tok, "--tokenizer-name-or-path", str(tmp_path / "nope"))
    assert "--tokenizer-name-or-path" in err and "no such file or directory" in err


def test_missing_sentencepiece_model(tmp_path, capsys, hf_tok):
    err = _usage(capsys, tmp_path, hf_tok, "--tokenizer-type", "SentencePieceTokenizer",
                 "--tokenizer-model", str(tmp_path / "x.model"))  # fmt: skip
    assert "--tokenizer-model" in err


def test_output_directory_not_writable(tmp_path, capsys, hf_tok):
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    err = _usage(capsys, tmp_path, hf_tok, "--output-prefix", str(blocker / "sub" / "o"))
    assert "not writable" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_output_directory_read_only(tmp_path, capsys, hf_tok):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    err = _usage(capsys, tmp_path, hf_tok, "--output-prefix", str(ro / "o"))
    assert "not writable" in err


def test_unknown_handler(tmp_path, capsys, hf_tok):
    err = _usage(capsys, tmp_path, hf_tok, "--handler-name", "NoSuchHandler")
    assert "unknown --handler-name 'NoSuchHandler'" in err


def test_other_bad_flags(tmp_path, capsys, hf_tok):
    assert "no such file" in _usage(capsys, tmp_path, hf_tok, src=str(tmp_path / "none.jsonl"))
    assert "--prompt-type" in _usage(
        capsys, tmp_path, hf_tok, "--handler-name", "AlpacaStyleInstructionHandler",
        "--prompt-type", "nope",
    )  # fmt: skip
    assert "--map-keys" in _usage(
        capsys, tmp_path, hf_tok, "--handler-name", "AlpacaStyleInstructionHandler",
        "--map-keys", "{bad",
    )  # fmt: skip
    assert "--pack" in _usage(capsys, tmp_path, hf_tok, "--pack", "--seq-length", "8")
    assert "--workers" in _usage(capsys, tmp_path, hf_tok, "--workers", "0")
    assert "unrecognized arguments" in _usage(capsys, tmp_path, hf_tok, "--bogus")


def test_existing_output_needs_overwrite(tmp_path, capsys, hf_tok, auto_tok):
    src = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": "new text"}])
    prefix = str(tmp_path / "o")
    for suffix in (".bin", ".idx"):
        (tmp_path / f"o_text_document{suffix}").write_bytes(b"old")
    argv = ["preprocess", "--input", src, "--output-prefix", prefix,
            "--tokenizer-name-or-path", hf_tok]  # fmt: skip
    rc, err = run_cli(capsys, *argv)
    assert rc == 2 and "exists; pass --overwrite" in err
    assert (tmp_path / "o_text_document.bin").read_bytes() == b"old"
    rc, err = run_cli(capsys, *argv, "--overwrite")
    assert rc == 0, err
    assert read_back(prefix + "_text_document") == [auto_tok("new text")["input_ids"]]
    assert _prefix_files(tmp_path) == ["o_text_document.bin", "o_text_document.idx"]


def test_unknown_subcommand(capsys):
    rc, err = run_cli(capsys, "frobnicate")
    assert rc == 2 and err.startswith("anyspeed: error:")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupted_run_leaves_no_dataset(tmp_path, hf_tok, sig):
    import signal
    import subprocess
    import sys
    import time

    line = '{"text": "' + " ".join(f"w{i % 997}x" for i in range(2000)) + '"}\n'
    (tmp_path / "big.jsonl").write_text(line * 1500)  # ~15 MB: seconds of work
    cmd = [sys.executable, "-m", "anyspeed.cli", "preprocess", "--input",
           str(tmp_path / "big.jsonl"), "--output-prefix", str(tmp_path / "o"), "--quiet",
           "--tokenizer-name-or-path", os.path.join(hf_tok, "tokenizer.json")]  # fmt: skip
    # A shell's background job (CI started with '&') ignores SIGINT, and a child inherits that:
    # Python then installs no KeyboardInterrupt handler. The run gets the default, as from a
    # terminal.
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 30
    while not any(".bin.tmp-" in f for f in leftovers(str(tmp_path))):
        assert proc.poll() is None and time.monotonic() < deadline, "run ended too early"
        time.sleep(0.01)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err
    assert _prefix_files(tmp_path) == []


def test_map_keys_names_only_what_the_handler_reads(tmp_path, capsys, hf_tok):
    """An unknown ``--map-keys`` name, a tag the handler has not, or a value that is not a field
    name is one line naming it and what the handler reads (issue 43, item 3)."""

    def err(handler: str, keys: str) -> str:
        return _usage(capsys, tmp_path, hf_tok, "--handler-name", handler, "--map-keys", keys)

    line = err("AlpacaStyleInstructionHandler", '{"respnse": "out"}')
    assert "reads no 'respnse'; it reads history, prompt, query, response, system" in line
    line = err("SharegptStyleInstructionHandler", '{"tags": {"speaker": "who"}}')
    assert "tags reads no 'speaker'" in line and "role_tag" in line
    assert "must name a record field" in err("AlpacaStylePairwiseHandler", '{"chosen": 3}')
