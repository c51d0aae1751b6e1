"""Prompts of each benchmark, zero- or few-shot, as plain text (the command tokenizes)."""

from __future__ import annotations

from anyspeed.inference.eval.readers import LETTERS, Choice


def _question(c: Choice) -> str:
    lines = [c.question.strip()]
    lines += [f"{LETTERS[i]}. {opt}" for i, opt in enumerate(c.options)]
    return "\n".join(lines) + "\nAnswer:"


def choice_prompt(c: Choice, shots: list[Choice], chinese: bool = False) -> str:
    """The usual MMLU layout: a subject line, ``shots`` solved examples, then the question;
    the model's next token is the answer letter."""
    subject = c.subject.replace("_", " ")
    head = (
        f"以下是关于{subject}的单项选择题，请直接给出正确答案的选项。\n\n"
        if chinese
        else f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    )
    solved = "".join(f"{_question(s)} {LETTERS[s.answer]}\n\n" for s in shots)
    return head + solved + _question(c)


def cloze_prompt(c: Choice, shots: list[Choice]) -> str:
    """MMLU scored by each option's likelihood (``mmlu_ppl``): solved examples answered with the
    option's text, then "Question: ... Answer:"; each option's text is the continuation."""
    head = f"The following are questions (with answers) about {c.subject.replace('_', ' ')}.\n\n"
    solved = "".join(
        f"Question: {s.question.strip()}\nAnswer: {s.options[s.answer].strip()}\n\n" for s in shots
    )
    return f"{head}{solved}Question: {c.question.strip()}\nAnswer:"


def boolq_prompt(passage: str, question: str) -> str:
    """Passage, question, and "Answer:" before " yes" / " no"."""
    q = question.strip()
    return f"{passage.strip()}\nQuestion: {q[0].upper() + q[1:]}?\nAnswer:"


def gsm8k_prompt(question: str, shots: list[tuple[str, str]]) -> str:
    """Few-shot "Question: ... Answer: ... The answer is N." prompts."""
    solved = "".join(f"Question: {q}\nAnswer: The answer is {a}.\n\n" for q, a in shots)
    return f"{solved}Question: {question.strip()}\nAnswer:"
