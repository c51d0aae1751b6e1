"""User reward functions for the GRPO reward tests, loaded by import path
(``--verifier-function helpers.user_rewards:<name>``): one good, the others broken on purpose."""

from __future__ import annotations

NOT_CALLABLE = 3


def exact(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """1.0 where the completion is the label (spaces aside), else 0.0."""
    pairs = zip(completions, labels, strict=True)
    return [1.0 if c.strip() == lab.strip() else 0.0 for c, lab in pairs]


def length(prompts: list[str], completions: list[str], labels: list[str]) -> tuple[int, ...]:
    """Each completion's length, as a tuple of ints (both accepted)."""
    return tuple(len(c) for c in completions)


def explodes(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """Raises on any completion containing 'boom'."""
    for c in completions:
        if "boom" in c:
            raise ValueError("cannot score this\nsecond line")
    return [0.0] * len(completions)


def strings(prompts: list[str], completions: list[str], labels: list[str]) -> list[str]:
    """Strings instead of numbers."""
    return ["1.0"] * len(completions)


def one_number(prompts: list[str], completions: list[str], labels: list[str]) -> float:
    """A single number instead of a list."""
    return 1.0


def one_too_many(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """One reward more than there are samples."""
    return [1.0] * (len(completions) + 1)


def nan_second(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """A nan for the second sample."""
    return [0.5, float("nan")] + [0.0] * (len(completions) - 2)


def bools(prompts: list[str], completions: list[str], labels: list[str]) -> list[bool]:
    """Booleans instead of numbers."""
    return [True] * len(completions)


def constant(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """The same reward for every sample: no advantage anywhere."""
    return [1.0] * len(completions)


def digits(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """The share of a completion's characters that are digits: a signal a random tiny model
    can learn in a few GRPO steps."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def always_fails(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """Raises on the first call."""
    raise RuntimeError("the verifier service is down")


def short(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """Shorter completions score higher (ending early, at the EOS, is learnable at once)."""
    return [-len(c) / 100 for c in completions]


def vowels(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """The share of a completion's letters that are vowels: most tokens move it a little, so
    a random tiny model learns it within a few GRPO steps."""
    out = []
    for c in completions:
        letters = [ch for ch in c.lower() if ch.isalpha()]
        out.append(sum(ch in "aeiou" for ch in letters) / max(len(letters), 1))
    return out


def fails_on_rank1(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """Raises on global rank 1 only: the other ranks must stop too, not wait."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 1:
        raise ValueError("rank 1's verifier broke")
    return [0.0] * len(completions)


def letter_a(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """How many times the completion has the letter a (a reward a random model varies on)."""
    return [float(c.count("a")) for c in completions]
