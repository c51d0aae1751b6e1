"""What every demo shares: the demo model's architecture, the standard-library corpus, the
tokenizer steps, the layout and the check that the loss fell."""

from __future__ import annotations

import glob
import json
import os
import random
import re
import statistics
import sysconfig

# Qwen2.5's architecture (GQA, QKV bias, RMSNorm, SwiGLU, RoPE, tied embeddings) at CPU size.
DEMO_ARCH = [
    "--model",
    "tiny-qwen2.5",
    "--num-layers",
    "4",
    "--hidden-size",
    "128",
    "--ffn-hidden-size",
    "352",
    "--num-attention-heads",
    "4",
    "--num-query-groups",
    "2",
    "--seq-length",
    "128",
    "--max-position-embeddings",
    "128",
]
DEMO_MODEL = [
    *DEMO_ARCH,
    "--micro-batch-size",
    "8",
    "--global-batch-size",
    "16",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "20",
    "--weight-decay",
    "0.1",
    "--adam-beta2",
    "0.95",
    "--clip-grad",
    "1.0",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--split",
    "98,1,1",
    "--eval-interval",
    "100",
    "--eval-iters",
    "4",
    "--log-interval",
    "25",
]
CORPUS_SEED = 0  # the documents' order: Megatron holds out the last ones (--split)
# With --moe: Qwen3-MoE's architecture (QK norm, 8 experts, top-2, aux loss) at CPU size,
# experts spread over the processes (expert parallel) with the all-to-all dispatcher.
DEMO_MOE = [
    "--moe-ffn-hidden-size",
    "128",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-grouped-gemm",
]
VOCAB = 1024
# What every fine-tuning demo passes: gradients clipped, no dropout, all data for training and
# no evaluation (each demo scores its model itself afterwards).
FINETUNE = [
    "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--split", "100,0,0", "--eval-iters", "0",
]  # fmt: skip
PROMPT = "def read_file(path):\n    "


# Tables a tool wrote, which say so in their first lines: codec maps (``encodings/cp1252.py``,
# "generated from ... with gencodec.py"), ``token.py``, ``pydoc_data/topics.py``. A tiny model
# memorises their repeated lines first and its samples come out as ``0x0011: 0x0011, # LATIN``.
GENERATED = re.compile(
    r"auto-?generated|generated (?:from|by|on)|do not edit|character mapping codec", re.IGNORECASE
)


def is_generated(text: str) -> bool:
    """Whether a source file declares itself generated (a table) in its first five lines."""
    return GENERATED.search("\n".join(text.split("\n", 5)[:5])) is not None


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files (top level and one folder down, tests left out),
    sorted, so every machine with this Python reads them in the same order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    files += sorted(glob.glob(os.path.join(stdlib, "*", "*.py")))
    return [
        f
        for f in files
        if "site-packages" not in f and "test" not in os.path.basename(os.path.dirname(f))
    ]


def build_corpus(path: str, max_bytes: int, split: str | None = None) -> tuple[list[str], int]:
    """Write stdlib ``.py`` files (see :func:`stdlib_files`; generated tables left out, see
    :data:`GENERATED`) as jsonl, up to ``max_bytes``.

    Files are drawn in a seeded shuffle, so the corpus samples the whole library (in sorted
    order the cut at ``max_bytes`` keeps its alphabetical start). Megatron's ``--split`` holds
    out the *last* documents, which in sorted order are one package's near-identical codec
    tables (``encodings/cp125x.py``); with ``split`` the held-out documents are instead picked
    evenly across the sorted list of the typical-size files written and put last, alternating
    between the validation and the test set. Returns the documents in corpus order (paths
    relative to the library) and their bytes.
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    files = stdlib_files()
    random.Random(CORPUS_SEED).shuffle(files)
    docs: dict[str, str] = {}
    size = 0
    for f in files:
        try:
            text = open(f, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 200 or is_generated(text):
            continue
        docs[os.path.relpath(f, stdlib)] = text
        size += len(text.encode())
        if size >= max_bytes:
            break
    names = list(docs)
    if split:
        kept = len(sum(held_out(names, split), []))
        # Typical files only: one outlier (pydoc_data/topics.py is 12% of the corpus, in
        # English) would make up most of a held-out set's tokens.
        median = statistics.median(len(t) for t in docs.values())
        listing = sorted(n for n in names if median / 4 <= len(docs[n]) <= 4 * median)
        picks = [listing[(2 * i + 1) * len(listing) // (2 * kept)] for i in range(kept)]
        spread = picks[0::2] + picks[1::2]
        names = [n for n in names if n not in set(spread)] + spread
    with open(path, "w", encoding="utf-8") as out:
        for name in names:
            out.write(json.dumps({"text": docs[name]}) + "\n")
    return names, size


def held_out(names: list[str], split: str) -> tuple[list[str], list[str]]:
    """The validation and test documents of ``names`` (in corpus order) under ``--split``,
    by Megatron's own rule (contiguous documents, bounds rounded)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    n, parts = len(names), []
    for bounds in convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[1:]:
        parts.append([] if bounds is None else names[round(bounds[0] * n) : round(bounds[1] * n)])
    return parts[0], parts[1]


def tokenizer_steps(
    workdir: str, corpus_mb: float, steps: int, split: str | None = None
) -> tuple[int, str]:
    """Steps 1 and 2 of every demo: the stdlib corpus and a BPE tokenizer trained on it;
    with ``split``, the documents it holds out are named. Returns (exit code, tokenizer
    directory)."""
    from anyspeed.commands.preprocess import main as data_main

    os.makedirs(workdir, exist_ok=True)
    corpus = os.path.join(workdir, "stdlib.jsonl")
    names, size = build_corpus(corpus, int(corpus_mb * 2**20), split)
    print(
        f"[1/{steps}] corpus: {len(names)} Python standard-library files (shuffled, seed "
        f"{CORPUS_SEED}), {size / 2**20:.1f} MB -> {corpus}"
    )
    if split:
        valid, test = held_out(names, split)
        print(
            f"      held out (--split {split}): validation {', '.join(valid) or 'none'}; "
            f"test {', '.join(test) or 'none'}"
        )
    tok_dir = os.path.join(workdir, "tokenizer")
    rc = data_main(
        [
            "train-tokenizer",
            "--input",
            corpus,
            "--vocab-size",
            str(VOCAB),
            "--output-dir",
            tok_dir,
            "--overwrite",
        ]
    )
    if rc == 0:
        print(f"[2/{steps}] tokenizer: byte-level BPE, {VOCAB} tokens -> {tok_dir}")
    return rc, tok_dir


def fresh_metrics(path: str) -> str:
    """``path``, emptied: ``--metrics-file`` appends, and a demo reads only its own run."""
    if os.path.exists(path):
        os.remove(path)
    return path


def loss_fell(metrics: str, what: str) -> tuple[bool, list[dict]]:
    """Whether the logged loss clearly fell (last < 0.75 x first), said in one line; the rows."""
    rows = [json.loads(line) for line in open(metrics)]
    first, last = rows[0]["lm_loss"], rows[-1]["lm_loss"]
    fell = last < 0.75 * first
    print(
        f"demo: {what} {first:.3f} (iteration {rows[0]['iteration']}) -> {last:.3f} "
        f"(iteration {rows[-1]['iteration']}): "
        + ("clearly falling, OK" if fell else "NOT clearly falling")
    )
    return fell, rows


def loss_halved(metrics: str, what: str) -> bool:
    """:func:`loss_fell`, and whether the loss fell by at least half, each said in one line."""
    fell, rows = loss_fell(metrics, what)
    first, last = rows[0]["lm_loss"], rows[-1]["lm_loss"]
    halved = last <= 0.5 * first
    print(
        f"demo: {what} fell {100 * (1 - last / first):.0f}% "
        + ("(at least 50%, OK)" if halved else "(less than 50%)")
    )
    return fell and halved


def tp_layout(n: int) -> list[str]:
    """The demos' layout on ``n`` processes: tensor parallel over all, sequence parallel."""
    return ["--tensor-model-parallel-size", str(n), *(["--sequence-parallel"] if n > 1 else [])]
