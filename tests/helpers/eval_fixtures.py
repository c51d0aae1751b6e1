"""Generated benchmark files in each layout ``anyspeed evaluate`` reads (no downloads)."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

LETTERS = "ABCD"


def _question(rng: random.Random, subject: str, i: int, planted: bool) -> tuple[list[str], str]:
    answer = LETTERS[rng.randrange(4)]
    opts = [f"{subject} option {j}, {rng.randrange(1000)}" for j in range(4)]
    key = f" (key: {answer})" if planted else ""
    return [f'Question {i} on {subject}: which one, "quoted"?{key}', *opts], answer


def write_mmlu(root: Path, subjects: dict[str, int], shots: int = 0, seed: int = 0,
               planted: bool = False) -> dict[str, list[str]]:  # fmt: skip
    """MMLU: header-less ``test/{s}_test.csv`` and ``dev/{s}_dev.csv``; the answers."""
    rng, answers = random.Random(seed), {}
    for split, count in (("test", None), ("dev", shots)):
        (root / split).mkdir(parents=True, exist_ok=True)
        for subject, n in subjects.items():
            if split == "dev" and not count:
                continue
            with open(root / split / f"{subject}_{split}.csv", "w", newline="") as f:
                w = csv.writer(f)
                for i in range(count or n):
                    row, ans = _question(rng, subject, i, planted)
                    w.writerow([*row, ans])
                    if split == "test":
                        answers.setdefault(subject, []).append(ans)
    return answers


def write_cmmlu(root: Path, subjects: dict[str, int], seed: int = 0) -> dict[str, list[str]]:
    """CMMLU: ``test/{s}.csv`` and ``dev/{s}.csv`` with the header ``,Question,A,B,C,D,Answer``."""
    rng, answers = random.Random(seed), {}
    for split in ("test", "dev"):
        (root / split).mkdir(parents=True, exist_ok=True)
        for subject, n in subjects.items():
            with open(root / split / f"{subject}.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["", "Question", "A", "B", "C", "D", "Answer"])
                for i in range(n):
                    row, ans = _question(rng, subject, i, False)
                    w.writerow([i, *row, ans])
                    if split == "test":
                        answers.setdefault(subject, []).append(ans)
    return answers


def write_ceval(root: Path, subjects: dict[str, int], seed: int = 0) -> dict[str, list[str]]:
    """C-Eval: ``val/{s}_val.csv`` and ``dev/{s}_dev.csv`` (``id,question,A,B,C,D,answer``,
    dev with ``explanation``), plus an answer-less ``test/{s}_test.csv``."""
    rng, answers = random.Random(seed), {}
    for split in ("val", "dev", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
        for subject, n in subjects.items():
            header = ["id", "question", "A", "B", "C", "D"]
            header += {"val": ["answer"], "dev": ["answer", "explanation"], "test": []}[split]
            with open(root / split / f"{subject}_{split}.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(header)
                for i in range(n):
                    row, ans = _question(rng, subject, i, False)
                    extra = {"val": [ans], "dev": [ans, "because"], "test": []}[split]
                    w.writerow([i, *row, *extra])
                    if split == "val":
                        answers.setdefault(subject, []).append(ans)
    return answers


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
