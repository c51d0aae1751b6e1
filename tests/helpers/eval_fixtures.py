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


def write_bbh(root: Path, tasks: dict[str, int], seed: int = 0, cot: bool = False) -> Path:
    """BIG-Bench Hard: ``bbh/{task}.json`` = ``{"examples": [{"input", "target"}]}`` with
    "(X)" targets (tasks named ``*choice*``) or free-form ones, each question carrying its
    planted key; ``cot-prompts/{task}.txt`` beside it when ``cot``. Returns ``bbh/``."""
    rng = random.Random(seed)
    (root / "bbh").mkdir(parents=True, exist_ok=True)
    for task, n in tasks.items():
        examples = []
        for i in range(n):
            if "choice" in task:
                target = f"({'ABCDE'[rng.randrange(5)]})"
                opts = "\n".join(f"({c}) {task} thing {rng.randrange(99)}" for c in "ABCDE")
                text = f"Question {i}: pick one (key: {target})\nOptions:\n{opts}"
            else:
                target = rng.choice(["True", "False", "valid", "invalid", str(rng.randrange(99))])
                text = f"Question {i}: evaluate (key: {target})"
            examples.append({"input": text, "target": target})
        (root / "bbh" / f"{task}.json").write_text(json.dumps({"examples": examples}))
        if cot:
            (root / "cot-prompts").mkdir(exist_ok=True)
            solved = f"Q: {task} example\nA: Let's think step by step. So the answer is no."
            (root / "cot-prompts" / f"{task}.txt").write_text(f"{task} description\n\n{solved}")
    return root / "bbh"


def write_agieval(root: Path, seed: int = 0) -> dict[str, list[str]]:
    """AGIEval v1_1: ``{task}.jsonl`` for an English multiple-choice task with passages (five
    options written "(A)..."), a Chinese one with a multi-answer label, and a cloze task; each
    question carries its planted key. Returns the answers."""
    rng, answers = random.Random(seed), {}
    root.mkdir(parents=True, exist_ok=True)
    for task in ("lsat-ar", "gaokao-physics", "gaokao-mathcloze"):
        recs = []
        for i in range(4):
            if task == "gaokao-mathcloze":
                ans = f"\\frac{{{rng.randrange(9) + 1}}}{{2}}"
                recs.append({"passage": None, "question": f"求值 {i} (key: {ans})",
                             "options": None, "label": None, "answer": f"${ans}$"})  # fmt: skip
                answers.setdefault(task, []).append(ans)
                continue
            n = 5 if task == "lsat-ar" else 4
            label = "ABCDE"[rng.randrange(n)] if task == "lsat-ar" else sorted(
                rng.sample("ABCD", 2))  # fmt: skip
            key = label if isinstance(label, str) else "".join(label)
            recs.append({"passage": f"Passage {i} of {task}." if task == "lsat-ar" else None,
                         "question": f"Which {i}? (key: {key})",
                         "options": [f"({c}){task} choice {j}" for j, c in enumerate("ABCDE"[:n])],
                         "label": label, "answer": None, "other": None})  # fmt: skip
            answers.setdefault(task, []).append(key)
        write_jsonl(root / f"{task}.jsonl", recs)
    return answers


NEEDLES = [("The secret ingredient of the harbor cake is saffron.", "What is the secret ingredient "
            "of the harbor cake?", "saffron", "English"),
           ("Mira's bicycle is painted turquoise.", "What colour is Mira's bicycle?", "turquoise",
            "English"),
           ("仓库的密码是四七二一。", "仓库的密码是什么？", "四七二一", "Chinese")]  # fmt: skip


def write_needlebench(root: Path) -> Path:
    """NeedleBench's layout: ``needles.jsonl`` and two haystacks of numbered sentences
    (``essays.jsonl`` in English, ``zh_notes.jsonl`` in Chinese)."""
    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(root / "needles.jsonl", [
        {"needle": n, "retrieval_question": q, "arg2": k, "language": lang}
        for n, q, k, lang in NEEDLES])  # fmt: skip
    write_jsonl(root / "essays.jsonl", [
        {"text": " ".join(f"Sentence {i}.{j} is about the weather on day {j}." for j in range(30))}
        for i in range(20)])  # fmt: skip
    write_jsonl(
        root / "zh_notes.jsonl", [{"text": "".join(f"第{i}天的天气很好。" for i in range(200))}]
    )
    return root
