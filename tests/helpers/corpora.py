"""Shared corpus, tiny tokenizers and Megatron read-back helpers for the preprocess tests."""

from __future__ import annotations

import glob
import json
import os
import random
import warnings

import numpy as np
import pytest
import torch

from anyspeed.commands.preprocess import main

_WORDS = (
    "the model trains on any device with megatron core and a tiny tokenizer café naïve "
    "日本語 данные δεδομένα 123 4.5 (x) [y] {z} \"quoted\" 'single' a,b;c tab\there emoji 🙂"
).split(" ")


def make_docs(n: int = 240, seed: int = 0, newlines: bool = False) -> list[str]:
    """Deterministic varied documents (unicode, punctuation, optional embedded newlines)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(1, 60))]
        if newlines and i % 5 == 0:
            words.insert(len(words) // 2, "\n")
        docs.append(" ".join(words) + f" #{i}")
    return docs


def write_jsonl(path: str, records: list[dict]) -> str:
    """One JSON object per line (UTF-8, non-ASCII kept)."""
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    """Run ``anyspeed.commands.preprocess.main`` in-process; returns (exit code, stderr)."""
    capsys.readouterr()
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def read_back(prefix: str) -> list[list[int]]:
    """Every sequence of a dataset, read through Megatron's own IndexedDataset."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def dataset_dtype(prefix: str) -> object:
    """The token dtype Megatron's reader sees for a dataset."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix).index.dtype


def files_bytes(prefix: str) -> tuple[bytes, bytes]:
    """Raw (.bin, .idx) contents, to compare runs byte for byte."""
    with open(prefix + ".bin", "rb") as b, open(prefix + ".idx", "rb") as i:
        return b.read(), i.read()


def leftovers(directory: str) -> list[str]:
    """Every file in a directory (used to prove nothing, not even a temp file, was left)."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*")))


def train_tokenizer(root: str) -> str:
    """A byte-level BPE (vocab 600) trained by ``train-tokenizer`` on a generated corpus."""
    corpus = write_jsonl(
        os.path.join(root, "corpus.jsonl"), [{"text": d} for d in make_docs(800, 1)]
    )
    out = os.path.join(root, "hf")
    rc = main(["train-tokenizer", "--input", corpus, "--vocab-size", "600", "--output-dir", out])
    assert rc == 0
    return out


ARITH_EOD = 499  # the pretraining tests' vocabulary of 500, its last id the EOD


def write_corpus(prefix: str, docs: int = 400, seed: int = 0) -> str:
    """Documents of learnable arithmetic token sequences, each ending with ARITH_EOD."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(docs):
        n = int(rng.integers(8, 120))
        start, stride = int(rng.integers(0, ARITH_EOD)), int(rng.integers(1, 7))
        doc = (start + stride * np.arange(n)) % ARITH_EOD
        builder.add_document(torch.from_numpy(np.append(doc, ARITH_EOD).astype(np.int64)), [n + 1])
    builder.finalize(prefix + ".idx")
    return prefix
