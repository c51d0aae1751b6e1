"""Single-needle retrieval (NeedleBench S-RT): a fact hidden at a chosen depth of a long
haystack, and a question only that fact answers.

Data (``--task-data-path``, NeedleBench's layout): ``needles.jsonl`` records ``{"needle",
"retrieval_question", "arg2" (the answer's keyword), "language": "English" | "Chinese"}`` and
haystack files ``{name}.jsonl`` of ``{"text"}`` records (``PaulGrahamEssays.jsonl``,
``zh_finance.jsonl``, ...; a ``zh`` name takes the Chinese needles). For every haystack, context
length and depth one item is built: the haystack's tokens cut so the whole prompt fits the
length, the needle put in at the first sentence end after ``depth`` percent of the text, then the
question. An answer is right when it contains the keyword.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from anyspeed.inference.eval.readers import TaskDataError, files_under, read_jsonl

DEPTHS = (0, 25, 50, 75, 100)
_ENDS = (". ", "。", "! ", "? ", "\n")


@dataclass(frozen=True)
class Needle:
    text: str
    question: str
    keyword: str
    language: str


@dataclass(frozen=True)
class Haystack:
    name: str
    text: str

    @property
    def language(self) -> str:
        return "Chinese" if self.name.startswith("zh") else "English"


def read_needlebench(root: str) -> tuple[list[Needle], list[Haystack]]:
    """The needles and every haystack file under ``root``."""
    files = files_under(root, (".jsonl",))
    needles_path = next((f for f in files if f.name == "needles.jsonl"), None)
    if needles_path is None:
        raise TaskDataError(f"--task-data-path {root!r}: no needles.jsonl (NeedleBench's layout)")
    needles = []
    for i, rec in enumerate(read_jsonl(str(needles_path)), 1):
        missing = [k for k in ("needle", "retrieval_question", "arg2") if not rec.get(k)]
        if missing:
            raise TaskDataError(f"{needles_path}:{i}: a needle lacks {', '.join(missing)}")
        text, question = str(rec["needle"]).strip(), str(rec["retrieval_question"]).strip()
        needles.append(
            Needle(text, question, str(rec["arg2"]).strip(), rec.get("language", "English"))
        )
    stacks = []
    for path in files:
        if path == needles_path:
            continue
        texts = [str(r.get("text", "")) for r in read_jsonl(str(path))]
        if not any(t.strip() for t in texts):
            raise TaskDataError(f'{path}: no "text" in its records (a haystack file)')
        stacks.append(Haystack(Path(path.name).stem, "\n".join(t.strip() for t in texts)))
    if not stacks:
        raise TaskDataError(f"--task-data-path {root!r}: no haystack .jsonl beside needles.jsonl")
    return needles, stacks


def _at_sentence_end(text: str, at: int) -> int:
    """The first position at or after ``at`` that follows a sentence end (else the end)."""
    found = [i + len(e) for e in _ENDS if (i := text.find(e, at)) >= 0]
    return min(found, default=len(text))


def _prompt(context: str, needle: Needle) -> str:
    if needle.language == "Chinese":
        return f"以下是一份长文档：\n{context}\n\n根据文档回答：{needle.question}\n答案："
    return (
        f"This is a long document:\n{context}\n\nAnswer from the document: "
        f"{needle.question}\nAnswer:"
    )


def build_prompt(
    hay_ids: list[int],
    needle: Needle,
    length: int,
    depth: int,
    count: Callable[[str], int],
    detok: Callable[[list[int]], str],
) -> str:
    """The prompt of ``length`` tokens at most (``count`` measures) from the haystack's tokens
    ``hay_ids`` (repeated when short), the needle at ``depth`` percent of the text kept."""
    room = length - count(_prompt(needle.text, needle)) - 8  # a few tokens for joins
    if room <= 0:
        raise TaskDataError(
            f"a needlebench context length of {length} tokens leaves no room "
            "for the haystack (longer --needle-lengths)"
        )
    ids = list(hay_ids)
    while len(ids) < room:  # a short haystack repeats
        ids += hay_ids
    hay = detok(ids[:room])
    cut = (
        0
        if depth == 0
        else len(hay)
        if depth == 100
        else _at_sentence_end(hay, len(hay) * depth // 100)
    )
    return _prompt(f"{hay[:cut].rstrip()} {needle.text} {hay[cut:].lstrip()}".strip(), needle)


Item = tuple[Haystack, Needle, int, int]


def needle_items(
    needles: list[Needle],
    stacks: list[Haystack],
    lengths: list[int],
    depths: tuple[int, ...],
    seed: int = 0,
) -> list[Item]:
    """(haystack, needle, length, depth) for every haystack x length x depth; the needle of each
    is drawn (seeded) from those in the haystack's language."""
    rng = random.Random(seed)
    out = []
    for stack in stacks:
        mine = [n for n in needles if n.language == stack.language] or needles
        for length in lengths:
            for depth in depths:
                out.append((stack, rng.choice(mine), length, depth))
    return out


def found(answer: str, needle: Needle) -> bool:
    """Whether the answer names the needle's keyword (case-insensitive)."""
    return needle.keyword.lower() in answer.lower()
