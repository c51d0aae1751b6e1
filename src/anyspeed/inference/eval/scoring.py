"""Scorers on a model at any layout: the next-token logits of a batch of prompts (the answer
letter of a multiple-choice question), and perplexity of token sequences.

Prompts are left-padded into one batch (padding masked, as in generation); every result is
computed on the last pipeline stage and shared, so all ranks agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from anyspeed.inference.decode import Batch, share
from anyspeed.inference.forward import pipeline_forward, pipeline_logprobs

NextLogits = Callable[[Sequence[Sequence[int]]], torch.Tensor | None]


def model_next_logits(model: list[torch.nn.Module], pad_id: int = 0) -> NextLogits:
    """A function giving the logits [b, vocab] after each prompt (None off the last stage)."""

    def next_logits(prompts: Sequence[Sequence[int]]) -> torch.Tensor | None:
        batch = Batch.left_padded(prompts, pad_id)
        width = batch.tokens.shape[1]
        out = pipeline_forward(model, batch.tokens, batch.positions(0, width), batch.mask(0, width))
        return None if out is None else out[:, -1].float().cpu()

    return next_logits


def pick_choices(
    next_logits: NextLogits,
    prompts: Sequence[Sequence[int]],
    candidates: Sequence[int],
    batch_size: int = 1,
) -> list[int]:
    """For each prompt the index into ``candidates`` (token ids, e.g. " A".." D") with the
    highest next-token logit."""
    picks: list[int] = []
    ids = torch.tensor(list(candidates))
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        logits = next_logits(chunk)
        best = torch.zeros(len(chunk), dtype=torch.int64)
        if logits is not None:
            best = logits[:, ids].argmax(dim=-1)
        picks += share(best).tolist()
    return picks


@torch.inference_mode()
def sequence_nll(
    model: list[torch.nn.Module],
    sequences: Sequence[Sequence[int]],
    batch_size: int = 1,
    pad_id: int = 0,
) -> tuple[float, int]:
    """Summed negative log-likelihood of every token after the first, and their count."""
    total, count = 0.0, 0
    for start in range(0, len(sequences), batch_size):
        chunk = [list(s) for s in sequences[start : start + batch_size] if len(s) > 1]
        if not chunk:
            continue
        batch = Batch.left_padded(chunk, pad_id)
        width = batch.tokens.shape[1]
        out = pipeline_logprobs(
            model,
            batch.tokens,
            _next_tokens(batch.tokens),
            batch.positions(0, width),
            batch.mask(0, width),
        )
        nll = torch.zeros(1, dtype=torch.float64)
        if out is not None:
            got = out[:, :-1].cpu()  # slot p scores the token at slot p + 1
            real = torch.arange(1, width)[None] > batch.pad[:, None]  # targets that are text
            nll[0] = -float(got[real].double().sum())
        total += float(share(nll)[0])
        count += sum(len(s) - 1 for s in chunk)
    return total, count


@torch.inference_mode()
def continuation_logprobs(
    model: list[torch.nn.Module],
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    batch_size: int = 1,
    pad_id: int = 0,
    vocab_size: int | None = None,
) -> list[tuple[float, int]]:
    """For each (context, continuation) pair: the summed log-probability of the continuation's
    tokens after the context, and their count (``vocab_size``: the real vocabulary, without the
    embedding's padded rows)."""
    out: list[tuple[float, int]] = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        batch = Batch.left_padded([list(c) + list(x) for c, x in chunk], pad_id)
        width = batch.tokens.shape[1]
        logp = pipeline_logprobs(
            model,
            batch.tokens,
            _next_tokens(batch.tokens),
            batch.positions(0, width),
            batch.mask(0, width),
            vocab_size,
        )
        sums = torch.zeros(len(chunk), dtype=torch.float64)
        if logp is not None:
            for row, (_, cont) in enumerate(chunk):
                n = len(cont)  # slot p scores the token at slot p + 1
                sums[row] = float(logp[row, width - 1 - n : width - 1].double().sum())
        sums = share(sums)
        out += [(float(s), len(x)) for s, (_, x) in zip(sums, chunk, strict=True)]
    return out


def _next_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Each slot's label: the next token (the last slot's, unused, is the pad 0)."""
    return torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
