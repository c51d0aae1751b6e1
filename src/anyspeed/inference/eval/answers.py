"""Answers read out of model output and compared with the gold, in one place for the evaluator
(``anyspeed evaluate``'s GSM8K score) and the GRPO rule rewards: the number a GSM8K completion
gives, the last ``\\boxed{}`` or ``<answer>`` of a math completion, their normal forms and an
exact comparison (as strings, or as exact numbers: '0.5' == '1/2' == '\\frac{1}{2}')."""

from __future__ import annotations

import re
from fractions import Fraction

GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
LAST_NUMBER = re.compile(r"-?[0-9][0-9\,]*\.?[0-9]*")
_DECIMAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d*)?")
# (sign, numerator, denominator): \frac{a}{b}, \frac12, a/b
_RATIOS = (
    re.compile(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}"),
    re.compile(r"(-?)\\frac(\d)(\d)"),
    re.compile(r"()([^/]+)/([^/]+)"),
)
_LEFT_RIGHT = re.compile(r"\\(left|right)(?![a-zA-Z])")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
R1_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def exact_number(text: str) -> Fraction | None:
    """A normalised answer as an exact number: a decimal (``-3``, ``2.50``, ``.5``), ``a/b``,
    ``\\frac{a}{b}`` or ``\\frac12`` (a leading ``-`` allowed); None for anything else."""
    if _DECIMAL.fullmatch(text):
        return Fraction(text)
    for pattern in _RATIOS:
        if (m := pattern.fullmatch(text)) and _DECIMAL.fullmatch(m[2]) and _DECIMAL.fullmatch(m[3]):
            value, den = Fraction(m[2]), Fraction(m[3])
            return None if den == 0 else (-value if m[1] else value) / den
    return None


def same_answer(answer: str, gold: str) -> float:
    """1.0 if two normalised answers are equal as strings or as numbers, else 0.0."""
    if not answer or not gold:
        return 0.0
    if answer == gold:
        return 1.0
    a, b = exact_number(answer), exact_number(gold)
    return 1.0 if a is not None and a == b else 0.0


def norm_gsm8k(text: str) -> str:
    """A GSM8K answer normalised: stripped, commas removed, one trailing '.' removed."""
    return text.strip().replace(",", "").removesuffix(".")


def norm_math(text: str) -> str:
    """A math answer normalised: whitespace, ``\\left``/``\\right``, ``\\!``/``\\,``/``\\;``
    and ``$`` removed, ``\\dfrac``/``\\tfrac`` read as ``\\frac``, one trailing '.' removed,
    thousands separators (``1,000``) removed."""
    text = _LEFT_RIGHT.sub("", text)
    for old, new in (
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("$", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
    ):
        text = text.replace(old, new)
    text = "".join(text.split()).removesuffix(".")
    return text.replace(",", "") if _THOUSANDS.fullmatch(text) else text


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced); None if there is none
    or it is not closed (a truncated answer)."""
    start = text.rfind("\\boxed{")
    begin, depth = start + len("\\boxed{"), 1
    for i in range(begin, len(text) if start >= 0 else 0):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def last_answer_tag(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>``, or that content's last ``\\boxed{}``."""
    found = _ANSWER.findall(text)
    return (last_boxed(found[-1]) or found[-1]) if found else None


def gsm8k_gold(label: str) -> str:
    """The label's answer: the text after its last ``####``, else the whole label."""
    return norm_gsm8k(label.rsplit("####", 1)[-1])


def math_gold(label: str) -> str:
    """The label's answer: the content of its last ``\\boxed{}``, else the whole label."""
    boxed = last_boxed(label)
    return norm_math(label if boxed is None else boxed)


# --- the evaluator's GSM8K reading
_EVAL_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_number(text: str) -> str | None:
    """The final answer of a GSM8K completion: the number after "The answer is" (a colon and
    ``$`` allowed, as lm-eval's gsm8k-cot filter reads it) or "####", else the last number;
    commas and a trailing ".0" dropped."""
    text = text.split("\n\nQuestion:")[0]
    m = re.search(r"(?:answer is|####)\s*:?\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", text, re.IGNORECASE)
    found = m.group(1) if m else (_EVAL_NUMBER.findall(text) or [None])[-1]
    return None if found is None else normalize_number(found)


def normalize_number(s: str) -> str:
    """``"1,234.0"`` -> ``"1234"``: the form answers are compared in."""
    s = s.replace(",", "").strip().rstrip(".")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s
