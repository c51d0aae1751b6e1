"""``anyspeed demo --sft``: its instruction set (fast), and the whole demo end to end (slow).

The instruction set is checked against the functions themselves, imported and read through
``inspect`` (the builder reads the files with ``ast`` and imports nothing)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import sysconfig

import pytest

from anyspeed import demo
from anyspeed.demo import common as demo_common
from anyspeed.demo.instructions import build_instructions, spread, write_jsonl

STDLIB = sysconfig.get_paths()["stdlib"]
FILES = [os.path.join(STDLIB, f"{m}.py") for m in ("bisect", "shlex", "textwrap")]


def test_instruction_set_is_valid_alpaca_and_deterministic(tmp_path):
    records = build_instructions(FILES, 400)
    assert records == build_instructions(FILES, 400)
    path = write_jsonl(str(tmp_path / "i.jsonl"), records)
    lines = open(path, encoding="utf-8").read().splitlines()
    assert [json.loads(line) for line in lines] == records
    assert len(records) >= 10
    for r in records:
        assert set(r) == {"instruction", "input", "output"}
        assert r["instruction"].strip() and r["output"].strip() and r["input"] == ""
        assert "\n" not in r["instruction"] + r["output"]
    assert len({r["instruction"] for r in records}) == len(records)
    assert build_instructions(FILES, 5) == spread(records, 5)
    assert len(spread(records, 5)) == 5 and spread(records, 5)[0] == records[0]


def test_answers_are_the_functions_docstrings_and_signatures():
    import textwrap

    records = {r["instruction"]: r["output"] for r in build_instructions(FILES, 400)}
    doc = inspect.getdoc(textwrap.fill).splitlines()[0]
    assert records["What does the function `textwrap.fill` do?"] == doc
    sig = f"def fill{inspect.signature(textwrap.fill)}:"
    assert records["Write the signature of `textwrap.fill`."] == sig
    assert not any("`textwrap._" in k for k in records)  # private functions left out


@pytest.mark.slow
def test_whole_stdlib_gives_a_few_hundred_spread_over_modules():
    records = build_instructions(demo_common.stdlib_files(), 400)
    assert len(records) == 400
    modules = {r["instruction"].split("`")[1].split(".")[0] for r in records}
    assert len(modules) > 40, sorted(modules)


def test_bad_demo_flags_are_one_line_before_any_work(capsys, tmp_path):
    work = str(tmp_path / "w")
    assert demo.main(["--sft", "--moe", "--workdir", work]) == 2
    assert capsys.readouterr().err == (
        "anyspeed demo: error: --sft/--dpo fine-tune the dense demo model; drop --moe\n"
    )
    assert demo.main(["--sft", "--sft-samples", "0", "--workdir", work]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anyspeed demo: error: --sft-samples 0:") and err.count("\n") == 1
    assert not os.path.exists(work)


@pytest.mark.slow
def test_sft_demo_answers_a_trained_prompt(tmp_path):
    """Eight samples, 60 steps: exit 0, the printed answer is the expected response, and the
    output is the demo's own lines (no third-party warnings)."""
    cmd = [sys.executable, "-m", "anyspeed", "demo", "--sft", "--workdir", str(tmp_path),
           "--corpus-mb", "0.5", "--sft-samples", "8", "--train-iters", "60"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    said = {line[:16]: line[16:] for line in out.stdout.splitlines()}
    expected, answer = said["demo: expected: "], said["demo: answer:   "]
    train = [json.loads(line) for line in open(tmp_path / "sft-train.jsonl")]
    assert expected == next(r["output"] for r in train if r["instruction"].startswith("What"))
    assert answer == expected
    assert "8 of 8 trained prompts answered exactly" in out.stdout
    assert all(line.startswith("anyspeed") for line in out.stderr.splitlines()), out.stderr
