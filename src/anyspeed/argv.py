"""Helpers for command lines held as lists of strings (before or instead of argparse).

Used where a command line is edited rather than parsed: a preset's flags merged under the
user's (explicit flags win), and ``--load <HF dir>`` rewritten to the converted checkpoint;
and :func:`factor_list`, the argparse type of a comma-separated list of numbers (shared by the
architecture flags and the MindSpeed-LLM spelling features).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def get_flag(argv: Sequence[str], flag: str, default: str | None = None) -> str | None:
    """The value of ``flag`` (``--x v`` or ``--x=v``; the last one wins), else ``default``."""
    value = default
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(flag + "="):
            value = tok.split("=", 1)[1]
    return value


def set_flag(argv: Sequence[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag`` set to ``value`` (replaced in place, or appended)."""
    out = list(argv)
    for i, tok in enumerate(out):
        if tok == flag and i + 1 < len(out):
            out[i + 1] = value
            return out
        if tok.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    return out + [flag, value]


def pop_flag(argv: Sequence[str], flag: str) -> tuple[str | None, list[str]]:
    """(value of ``flag`` or None, ``argv`` without it); ValueError when it has no value."""
    out, value, i = [], None, 0
    while i < len(argv):
        tok = argv[i]
        if tok == flag:
            if i + 1 >= len(argv):
                raise ValueError(f"{flag} needs a value")
            value, i = argv[i + 1], i + 2
            continue
        if tok.startswith(flag + "="):
            value, i = tok.split("=", 1)[1], i + 1
            continue
        out.append(tok)
        i += 1
    return value, out


def pop_values(argv: Sequence[str], flag: str) -> tuple[list[str] | None, list[str]]:
    """(the values of ``flag``, a flag of any number of values, or None; ``argv`` without it).
    Its values run to the next ``--`` token; the last occurrence wins."""
    out: list[str] = []
    values: list[str] | None = None
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith(flag + "="):
            values, i = [tok.split("=", 1)[1]], i + 1
        elif tok == flag:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            values, i = list(argv[i + 1 : j]), j
        else:
            out.append(tok)
            i += 1
    return values, out


def merge_flags(defaults: Sequence[str], argv: Sequence[str]) -> list[str]:
    """``defaults`` (flags with any number of values, ``--mrope-section 16 24 24``) then
    ``argv``, dropping defaults ``argv`` sets."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    j, kept = 0, []
    while j < len(defaults):
        end = j + 1
        while end < len(defaults) and not defaults[end].startswith("--"):
            end += 1
        if defaults[j] not in given:
            kept += defaults[j:end]
        j = end
    return kept + list(argv)


def factor_list(text: str) -> tuple[float, ...]:
    """``--long-factor`` / ``--short-factor``: MindSpeed-LLM's comma-separated numbers (one per
    rotary frequency), read as a tuple."""
    try:
        values = tuple(float(p) for p in text.replace(" ", "").strip("[]()").split(",") if p)
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"cannot read {text[:40]!r} (e.g. '1.0,1.02,1.05')")
    return values
