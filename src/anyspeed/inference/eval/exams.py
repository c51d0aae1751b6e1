"""BIG-Bench Hard and AGIEval: readers of their published layouts, prompts, answer checks.

Both are scored by greedy generation and answer extraction, as MindSpeed-LLM scores them.

* BBH (the BIG-Bench-Hard repository's ``bbh/`` folder): ``{task}.json`` =
  ``{"examples": [{"input", "target"}, ...]}``; chain-of-thought prompts ``{task}.txt`` in a
  ``cot-prompts/`` folder inside or beside it.
* AGIEval (the AGIEval repository's ``data/v1_1/``): ``{task}.jsonl`` records
  ``{"passage", "question", "options": ["(A)...", ...] | null, "label": "A" | ["A", "C"] | null,
  "answer": str | null}``; a record without options is a cloze question (``answer``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from anyspeed.inference.eval.readers import TaskDataError, files_under, read_jsonl

OPTION_LETTERS = "ABCDEFGHIJ"
CHINESE_TASKS = ("gaokao", "logiqa-zh", "jec-qa")


@dataclass(frozen=True)
class Exam:
    """One question: ``target`` is BBH's target, AGIEval's answer letters ("A", "AC") or its
    cloze answer; ``options`` are empty for free-form and cloze questions."""

    task: str
    question: str
    target: str
    options: tuple[str, ...] = ()
    passage: str = ""


def read_bbh(root: str) -> dict[str, list[Exam]]:
    """Every ``{task}.json`` under ``root``: its examples in file order."""
    files = files_under(root, (".json",))
    if not files:
        raise TaskDataError(f"--task-data-path {root!r}: no BBH task .json files")
    out = {}
    for path in files:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise TaskDataError(f"{path}: not JSON ({exc.msg})") from None
        if not isinstance(data, dict) or not isinstance(data.get("examples"), list):
            raise TaskDataError(f'{path}: no "examples" list (BIG-Bench Hard\'s task layout)')
        items = []
        for i, ex in enumerate(data["examples"]):
            if not isinstance(ex, dict) or "input" not in ex or "target" not in ex:
                raise TaskDataError(f"{path}: example {i} lacks input or target")
            items.append(Exam(path.stem, str(ex["input"]), str(ex["target"])))
        out[path.stem] = items
    return out


def bbh_cot_prompts(root: str) -> dict[str, str]:
    """Chain-of-thought prompt text per task from ``cot-prompts/`` inside or beside ``root``."""
    base = Path(root) if Path(root).is_dir() else Path(root).parent
    for folder in (base / "cot-prompts", base.parent / "cot-prompts"):
        if folder.is_dir():
            return {p.stem: p.read_text(encoding="utf-8") for p in folder.glob("*.txt")}
    raise TaskDataError(f"--chain-of-thought: no cot-prompts/ folder in or beside {str(base)!r}")


def bbh_prompt(item: Exam, shots: list[Exam], cot: str | None = None) -> str:
    """``Q: ... A:`` after solved examples, or after the task's chain-of-thought prompt."""
    if cot is not None:
        return f"{cot.strip()}\n\nQ: {item.question}\nA: Let's think step by step."
    solved = "".join(f"Q: {s.question}\nA: {s.target}\n\n" for s in shots)
    return f"{solved}Q: {item.question}\nA:"


def bbh_answer(text: str) -> str:
    """The answer in a completion: after the last "answer is", else its first line."""
    text = text.split("\n\nQ:")[0]
    found = re.findall(r"answer is\s*(.*)", text, flags=re.IGNORECASE)
    line = found[-1] if found else text.strip().split("\n")[0]
    return line.strip().rstrip(".").strip()


def bbh_correct(text: str, target: str) -> bool:
    """Whether a completion answers ``target``: the option letter of "(X)" targets, else the
    whole answer (case-insensitive)."""
    answer = bbh_answer(text)
    letter = re.fullmatch(r"\(([A-Z])\)", target.strip())
    if letter:
        got = re.search(r"\(([A-Z])\)", answer) or re.match(r"([A-Z])\b", answer)
        return got is not None and got.group(1) == letter.group(1)
    return answer.lower() == target.strip().lower()


def _option_text(option: str) -> str:
    return re.sub(r"^\s*\(?[A-J]\s*[).．、:：]\s*", "", str(option)).strip()


def _agieval_record(rec: dict, task: str, where: str) -> Exam:
    if "question" not in rec:
        raise TaskDataError(f"{where}: a record lacks question")
    passage = str(rec.get("passage") or "")
    options = tuple(_option_text(o) for o in rec.get("options") or ())
    if not options:
        if rec.get("answer") is None:
            raise TaskDataError(f"{where}: a cloze record (no options) lacks answer")
        return Exam(task, str(rec["question"]), str(rec["answer"]), (), passage)
    label = rec.get("label")
    letters = "".join(sorted(label if isinstance(label, list) else [label or ""]))
    if not letters or any(c not in OPTION_LETTERS[: len(options)] for c in letters):
        raise TaskDataError(
            f"{where}: label {label!r} is not a letter of its {len(options)} options"
        )
    return Exam(task, str(rec["question"]), letters, options, passage)


def read_agieval(root: str) -> dict[str, list[Exam]]:
    """Every ``{task}.jsonl`` under ``root``: its questions in file order."""
    files = files_under(root, (".jsonl",))
    if not files:
        raise TaskDataError(f"--task-data-path {root!r}: no AGIEval task .jsonl files")
    out = {}
    for path in files:
        task = path.name.removesuffix(".jsonl")
        recs = read_jsonl(str(path))
        out[task] = [_agieval_record(r, task, f"{path}:{i}") for i, r in enumerate(recs, 1)]
    return out


def agieval_prompt(item: Exam, shots: list[Exam]) -> str:
    """Passage, question, lettered options and "Answer:" ("答案：" for the Chinese exams),
    after solved examples of the same task."""
    chinese = item.task.startswith(CHINESE_TASKS)

    def block(e: Exam) -> str:
        lines = [e.passage.strip()] if e.passage.strip() else []
        lines.append(e.question.strip())
        lines += [f"{OPTION_LETTERS[i]}. {o}" for i, o in enumerate(e.options)]
        return "\n".join(lines) + ("\n答案：" if chinese else "\nAnswer:")

    solved = "".join(f"{block(s)} {s.target}\n\n" for s in shots)
    return solved + block(item)


def _plain(s: str) -> str:
    return re.sub(r"[\s$]", "", s).rstrip(".。")


# The AGIEval authors' scoring (their ``post_process``): these tasks' questions may have several
# right options, and every option letter A-F in the completion counts as chosen.
MULTI_ANSWER_TASKS = ("jec-qa-kd", "jec-qa-ca", "gaokao-physics")


def agieval_choice(text: str, item: Exam) -> str:
    """The option letters a completion chooses, as AGIEval's reference parses them: on a
    multi-answer task every letter A-F in it (sorted, once each); else the letter after
    "answer is" ("答案是" in the Chinese exams), or failing that its first capital A-F."""
    if item.task in MULTI_ANSWER_TASKS or len(item.target) > 1:
        return "".join(sorted(set(re.findall(r"[A-F]", text))))
    cue = "答案是" if item.task.startswith(CHINESE_TASKS) else "answer is"
    said = re.search(cue + r".*?([A-G])", text)
    if said:
        return said.group(1)
    first = re.search(r"[A-F]", text)
    return first.group(0) if first else ""


def agieval_correct(text: str, item: Exam) -> bool:
    """Multiple choice: the chosen option letters (:func:`agieval_choice`) equal the label;
    cloze: the completion's first line equals the answer (spaces and ``$`` ignored)."""
    if not item.options:
        line = next((x for x in text.strip().split("\n") if x.strip()), "")
        return _plain(line) == _plain(item.target)
    return agieval_choice(text, item) == item.target
