"""Step-labelled data for the process reward model tests: chains of one-digit additions, each
step ending with the placeholder ``@`` and labelled ``+`` when its sum is right, ``-`` when not."""

from __future__ import annotations

import random

PLACEHOLDER = "@"  # one token in the session tokenizer (Math-Shepherd's ``ки`` is four)
REWARDS = ("+", "-")


def step_records(n: int, seed: int = 0, steps: int = 3, top: int = 9) -> list[dict]:
    """``n`` records ``{"input": ..., "value": [...]}``: a question, then ``steps`` steps that
    each add a digit (1 to ``top``) to the running total, right or wrong by one or two (wrong
    about a third of the time; the chain goes on from the written total)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        total = rng.randint(1, 9)
        lines, labels = [f"Add to {total}."], []
        for _ in range(steps):
            d = rng.randint(1, top)
            right = rng.random() > 0.35
            written = total + d if right else total + d + rng.choice((-2, -1, 1, 2))
            lines.append(f"{total} + {d} = {written} {PLACEHOLDER}")
            labels.append(REWARDS[0] if right else REWARDS[1])
            total = written
        out.append({"input": "\n".join(lines), "value": labels})
    return out


def preprocess_steps(records: list[dict], prefix: str, tok: str, *flags: str) -> str:
    """``anyspeed preprocess`` of ``records`` with ``@`` and ``+``/``-`` (in-process)."""
    from helpers.corpora import write_jsonl
    from helpers.instruction import preprocess

    src = write_jsonl(f"{prefix}.jsonl", records)
    return preprocess(src, prefix, tok, "--prompt-type", "hf", "--placeholder-token",
                      PLACEHOLDER, "--reward-tokens", *REWARDS, *flags,
                      handler="AlpacaStyleProcessRewardHandler")  # fmt: skip
