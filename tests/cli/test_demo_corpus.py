"""``anyspeed demo``'s validation and test documents represent its corpus: built as the demo
builds it (the default 6 MB, the demo's ``--split``), the documents Megatron holds out come from
several parts of the standard library, at typical sizes, not from one package (sorted order put
seven near-identical ``encodings/cp125x.py`` codec tables there: validation loss 2.48 against a
training loss of 3.72)."""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter

from anyspeed.argv import get_flag
from anyspeed.demo import common as demo


def test_held_out_documents_sample_the_corpus(tmp_path):
    split = get_flag(demo.DEMO_MODEL, "--split")
    assert split is not None
    path = str(tmp_path / "stdlib.jsonl")
    names, _ = demo.build_corpus(path, int(6.0 * 2**20), split)
    valid, test = demo.held_out(names, split)
    held = valid + test
    assert valid and test and len(set(held)) == len(held)

    # Megatron holds out the last documents of the file: these, in this order.
    texts = [json.loads(line)["text"] for line in open(path, encoding="utf-8")]
    assert len(texts) == len(names) and names[len(names) - len(held) :] == held

    # Not one kind: no directory (the top level counted as one) has half of them, and at
    # most one codec table.
    top = Counter(os.path.dirname(n) for n in held).most_common(1)[0]
    assert top[1] < len(held) / 2, (top, held)
    assert sum(n.startswith("encodings/") for n in held) <= 1, held
    # Typical sizes: no outlier (pydoc_data/topics.py, 12% of the corpus) stands for a set.
    median = statistics.median(len(t) for t in texts)
    sizes = dict(zip(names, map(len, texts), strict=True))
    assert all(median / 4 <= sizes[n] <= 4 * median for n in held), held
