"""Rule rewards of the RL stages (reinforcement learning with verifiable rewards).

A reward function maps the batch's prompts, completions and labels (the reference answer text
as the dataset holds it) to one finite number per sample. :data:`BUILTIN` holds the rule
checkers; :func:`resolve` turns ``--verifier-function`` names (built-in or ``module:function``)
and weights into one weighted sum, checked before training; :func:`score` turns a crash or bad
result into a :class:`RewardError` naming the function and sample; :func:`overlong_penalty` is
DAPO's soft length penalty. Pure Python, no side effects at import.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence

from anyspeed.errors import UsageError
from anyspeed.inference.eval.answers import (
    GSM8K_STRICT,
    LAST_NUMBER,
    R1_FORMAT,
    gsm8k_gold,
    last_answer_tag,
    last_boxed,
    math_gold,
    norm_gsm8k,
    norm_math,
    same_answer,
)
from anyspeed.training.task import TaskStopped

# (prompts, completions, labels) -> one reward per sample
RewardFn = Callable[[list[str], list[str], list[str]], list[float]]
Extract = Callable[[str], str | None]  # a completion's answer, None if it has none

FLAG = "--verifier-function"


class RewardError(TaskStopped):
    """A reward function failed or returned something that is not a finite number; the message
    names the function and the sample (index, and the first 60 chars of its completion)."""


# --- the built-in rewards -----------------------------------------------------------------------


def _rule(
    completions: list[str], labels: list[str], extract: Extract, is_math: bool
) -> list[float]:
    """1.0 where the answer ``extract`` finds equals the label's, both normalised (the math or
    the GSM8K way); 0.0 where they differ or there is no answer."""
    norm, gold = (norm_math, math_gold) if is_math else (norm_gsm8k, gsm8k_gold)
    out = []
    for completion, label in zip(completions, labels, strict=True):
        answer = extract(completion)
        out.append(0.0 if answer is None else same_answer(norm(answer), gold(str(label))))
    return out


def _last_match(pattern: re.Pattern) -> Extract:
    return lambda text: (pattern.findall(text) or [None])[-1]


def gsm8k(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """GSM8K, strict (verl's rule): the answer is the number of the completion's last
    ``#### <number>``; none gives 0.0. Equal to the gold after removing commas and a trailing
    '.', or as numbers ('42.0' == '42'), gives 1.0."""
    return _rule(completions, labels, _last_match(GSM8K_STRICT), is_math=False)


def gsm8k_flexible(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """GSM8K, flexible: the answer is the completion's last number, compared as :func:`gsm8k`
    does (for models not trained to write ``####``)."""
    return _rule(completions, labels, _last_match(LAST_NUMBER), is_math=False)


def boxed(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """Math: the content of the completion's last ``\\boxed{...}`` against the label's last
    boxed content (or the whole label), after normalisation (spaces, ``\\left``/``\\right``,
    ``$``, ``\\dfrac``, a trailing '.'), equal as strings or as exact numbers ('0.5' ==
    '1/2' == '\\frac{1}{2}').

    Limits: not a symbolic checker. ``x+1`` vs ``1+x``, ``\\sqrt3`` vs ``\\sqrt{3}``, ``0.333``
    vs ``1/3``, units, ``\\text{}``, percentages, intervals and sets written differently all
    count as different; only ``\\boxed{`` is read (not ``\\boxed 5`` or ``\\fbox``).
    """
    return _rule(completions, labels, last_boxed, is_math=True)


def answer_tag(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """The content of the completion's last ``<answer>...</answer>`` (its last ``\\boxed{}``
    if it has one) against the gold as :func:`boxed` compares them; used with ``format``."""
    return _rule(completions, labels, last_answer_tag, is_math=True)


def r1_format(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """The R1 format reward: 1.0 if the completion is ``<think>...</think>`` then
    ``<answer>...</answer>`` and nothing else (whitespace aside), else 0.0."""
    return [1.0 if R1_FORMAT.match(c) else 0.0 for c in completions]


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def exact_match(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """1.0 when the completion's words are the label's (case and punctuation aside), else 0."""
    return [float(_words(c) == _words(lab)) for c, lab in zip(completions, labels, strict=True)]


def word_overlap(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """The share of the label's words the completion has, 0 to 1 (a caption's partial credit)."""
    out = []
    for c, lab in zip(completions, labels, strict=True):
        want, got = _words(lab), set(_words(c))
        out.append(sum(w in got for w in want) / len(want) if want else 0.0)
    return out


BUILTIN: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "word_overlap": word_overlap,
    "gsm8k": gsm8k,
    "gsm8k_flexible": gsm8k_flexible,
    "boxed": boxed,
    "base_acc": boxed,  # MindSpeed-RL's name for the boxed-answer accuracy
    "format": r1_format,
    "answer_tag": answer_tag,
}


# --- user functions, checked --------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _name(fn: Callable) -> str:
    """How messages name ``fn`` when not told: its ``module:qualname`` import path."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _sample(i: int, completions: Sequence[str]) -> str:
    return f"sample {i} ({str(completions[i])[:60]!r})"


def _raised(fn: Callable, name: str, batch: tuple[Sequence[str], ...], exc: Exception) -> str:
    """The message for a function that raised: the batch is retried one sample at a time to
    name the first sample that fails alone."""
    prompts, completions, labels = batch
    for i in range(len(completions)):
        try:
            fn([prompts[i]], [completions[i]], [labels[i]])
        except Exception as one:  # any failure of user code is reported
            return f"reward function {name} raised {_first_line(one)} on {_sample(i, completions)}"
    return (
        f"reward function {name} raised {_first_line(exc)} on a batch of {len(completions)} "
        "samples (no sample fails alone)"
    )


def _finite(value: object) -> float | None:
    """``value`` as a float if it is a real finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        out = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return out if math.isfinite(out) else None


def score(
    fn: Callable,
    prompts: Sequence[str],
    completions: Sequence[str],
    labels: Sequence[str],
    *,
    name: str | None = None,
) -> list[float]:
    """``fn(prompts, completions, labels)`` called safely: one float per sample, or a
    :class:`RewardError` naming the function (``name``, else its own) and the first bad sample
    if it raises, returns other than a list/tuple of one reward per sample, or returns an
    element that is not a finite int/float (bool, None, str, nan and inf are rejected)."""
    name = name or _name(fn)
    n = len(completions)
    if len(prompts) != n or len(labels) != n:
        raise ValueError(f"score: {len(prompts)} prompts, {n} completions, {len(labels)} labels")
    try:
        result = fn(prompts, completions, labels)
    except RewardError:  # a weighted sum's own function failed: its message already says how
        raise
    except Exception as exc:
        raise RewardError(_raised(fn, name, (prompts, completions, labels), exc)) from exc
    if not isinstance(result, (list, tuple)):
        raise RewardError(
            f"reward function {name} returned a {type(result).__name__}, not a list of {n} rewards"
        )
    if len(result) != n:
        raise RewardError(f"reward function {name} returned {len(result)} rewards for {n} samples")
    out = []
    for i, value in enumerate(result):
        reward = _finite(value)
        if reward is None:
            raise RewardError(
                f"reward function {name} returned {value!r} for "
                f"{_sample(i, completions)}: not a finite number"
            )
        out.append(reward)
    return out


def _load(name: str) -> Callable:
    """A built-in reward by name, or a callable by ``module:function`` import path."""
    from anyspeed.stages.common.user_code import load_callable

    return load_callable(name, BUILTIN, FLAG, "reward")


def resolve(names: Sequence[str], weights: Sequence[float] | None) -> RewardFn:
    """The weighted sum of the named reward functions (built-in names or ``module:function``
    import paths; weights default to 1.0 each). Bad names or weights raise a one-line
    :class:`UsageError` naming ``--verifier-function``. Called before training starts, so
    importing user modules happens here."""
    names = list(names)
    if not names:
        raise UsageError(f"{FLAG}: name at least one reward function")
    weights = [1.0] * len(names) if weights is None else list(weights)
    if len(weights) != len(names):
        raise UsageError(f"{FLAG}: {len(names)} reward functions but {len(weights)} weights")
    checked = []
    for name, weight in zip(names, weights, strict=True):
        w = _finite(weight)
        if w is None:
            raise UsageError(f"{FLAG} {name!r}: weight {weight!r} is not a finite number")
        checked.append((name, _load(name), w))

    def weighted(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
        total = [0.0] * len(completions)
        for name, fn, w in checked:
            for i, r in enumerate(score(fn, prompts, completions, labels, name=name)):
                total[i] += w * r
        return total

    weighted.__qualname__ = weighted.__name__ = " + ".join(f"{w}*{n}" for n, _, w in checked)
    return weighted


def overlong_penalty(lengths: list[int], max_len: int, buffer: int, factor: float) -> list[float]:
    """DAPO's soft overlong punishment, added to the reward: 0 up to ``max_len - buffer``
    tokens, then falling linearly by ``factor`` per ``buffer`` tokens beyond (``-factor`` at
    ``max_len``); all zeros when ``buffer <= 0``. Penalises near-truncated responses gently."""
    if buffer <= 0:
        return [0.0] * len(lengths)
    expected = max_len - buffer
    return [0.0 if n <= expected else min(-(n - expected) / buffer * factor, 0.0) for n in lengths]
