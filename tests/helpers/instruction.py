"""Instruction data for the fine-tuning tests: alpaca records and in-process preprocessing."""

from __future__ import annotations

import contextlib
import io
import random

from helpers.corpora import make_docs

VOCAB = 768  # the session tokenizer's 600 ids, padded for TP1 and TP2 alike (multiple of 2 x 128)


def preprocess(
    src: str, prefix: str, tok: str, *flags: str, handler: str = "AlpacaStyleInstructionHandler"
) -> str:
    """``anyspeed preprocess`` in-process (default: alpaca records, the qwen prompt type;
    ``--prompt-type hf``: the tokenizer's own chat template)."""
    from anyspeed.commands.preprocess import main

    if "--prompt-type" in flags and flags[flags.index("--prompt-type") + 1] == "hf":
        at = flags.index("--prompt-type")
        flags = flags[:at] + flags[at + 2 :]
    elif "--prompt-type" not in flags:
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


def chat_prompt_ids(auto_tok, history: list[dict], user: str, encode) -> tuple[list, list]:
    """(prompt token ids, the conversation) of ``history`` + a ``user`` turn through the
    tokenizer's chat template, cut as the instruction handler cuts it: each turn's prompt, then
    its response (``encode(text)``: the test's own encoding of a piece)."""
    msgs = [*history, {"role": "user", "content": user}]

    def render(m: list[dict], gen: bool) -> str:
        return auto_tok.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)

    p1 = render(history[:1], True)
    h1 = render(history, False)
    p2 = render(msgs, True)
    return encode(p1) + encode(h1[len(p1) :]) + encode(p2[len(h1) :]), msgs
