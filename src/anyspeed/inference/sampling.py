"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling.

Sampling draws from a CPU ``torch.Generator`` seeded once per run (``--seed``), never from a
device generator, so the same seed gives the same tokens on every device and at every TP size
(the logits are gathered over TP before the choice). Megatron's text-generation controller
creates ``torch.Generator(device=<cuda index>)``, which fails off CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; ``greedy`` ignores the rest."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut

    def check(self) -> None:
        """ValueError naming the flag when a value is out of its range."""
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits`` [b, vocab] scaled by the temperature, with tokens outside top-k / top-p at
    -inf (the most likely token always survives)."""
    out = logits.float() / params.temperature
    if params.top_k and params.top_k < out.shape[-1]:
        kth = torch.topk(out, params.top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The next token of each row of ``logits`` [b, vocab] (int64 [b], on the CPU)."""
    logits = logits.detach().float().cpu()
    if params.greedy:  # the first of equal maxima, as argmax; max's reduction is 3x faster
        return logits.max(dim=-1).indices
    probs = filter_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
