"""Instruction data for the fine-tuning tests: alpaca records and in-process preprocessing."""

from __future__ import annotations

import contextlib
import io
import random

from helpers.corpora import make_docs


def preprocess(
    src: str, prefix: str, tok: str, *flags: str, handler: str = "AlpacaStyleInstructionHandler"
) -> str:
    """``anyspeed preprocess`` in-process (default: alpaca records, the qwen prompt type)."""
    from anyspeed.commands.preprocess import main

    if "--prompt-type" not in flags:
        flags = ("--prompt-type", "qwen", *flags)
    argv = [
        "preprocess",
        "--input",
        src,
        "--output-prefix",
        prefix,
        "--tokenizer-name-or-path",
        tok,
        "--handler-name",
        handler,
        *flags,
    ]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        rc = main(argv)
    assert rc == 0, err.getvalue()
    return prefix


def alpaca_records(n: int, seed: int = 3) -> list[dict]:
    """Short instruction/response pairs of widely varying lengths."""
    words = make_docs(4 * n, seed=seed)
    rng = random.Random(seed)
    return [
        {
            "instruction": " ".join(words[4 * i].split()[: rng.randint(1, 6)]),
            "input": "",
            "output": " ".join(words[4 * i + 1].split()[: rng.randint(1, 12)]),
        }
        for i in range(n)
    ]


def pairwise_records(n: int, seed: int = 3) -> list[dict]:
    """Alpaca pairwise records: the expected answer chosen, the same words reversed and
    shortened rejected (answers of different lengths)."""
    rng = random.Random(seed + 1)
    out = []
    for rec in alpaca_records(n, seed):
        words = rec["output"].split()
        bad = " ".join(reversed(words[: max(1, len(words) - rng.randint(0, 3))])) + " no"
        out.append({"instruction": rec["instruction"], "input": "", "chosen": rec["output"],
                    "rejected": bad})  # fmt: skip
    return out
