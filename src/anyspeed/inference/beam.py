"""Beam search over one prompt (``--task beam_search``), KV cache reordered with the beams.

The classic procedure: each step every live beam is extended by every token, the best
``2 * beams`` candidates (by summed log-probability) are walked in order, a candidate ending in
EOS becomes a finished hypothesis scored ``logp / length ** length_penalty``, the others refill
the live beams. It stops when ``beams`` hypotheses are finished and no live beam can beat the
worst of them, or at the token budget. With sampling parameters (``beam_search_with_sampling``)
the ``2 * beams`` candidates are drawn without replacement from the softmax of the beams' summed
log-probabilities plus the temperature / top-k / top-p filtered next-token log-probabilities
(seeded by ``--seed``, the same on every rank), then walked best first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from anyspeed.inference.decode import Batch, Request, Stepper, share, token_budget
from anyspeed.inference.sampling import SamplingParams, filter_logits


def _pick(
    total: torch.Tensor,
    logits: torch.Tensor,
    scores: torch.Tensor,
    k: int,
    params: SamplingParams,
    gen: torch.Generator,
) -> tuple[torch.Tensor, ...]:
    """``k`` flat (beam, token) indices: the best by ``total``, or drawn from the filtered
    distribution; with their ``total`` scores, best first."""
    if params.greedy:
        return torch.topk(total.flatten(), k)
    warped = (scores[:, None] + filter_logits(logits, params).log_softmax(dim=-1)).flatten()
    probs = warped.softmax(dim=-1)
    k = min(k, int((probs > 0).sum()))
    flat = torch.multinomial(probs, k, replacement=False, generator=gen)
    vals, order = total.flatten()[flat].sort(descending=True)
    return vals, flat[order]


def _candidates(
    logits: torch.Tensor | None,
    scores: torch.Tensor,
    k: int,
    n: int,
    params: SamplingParams,
    gen: torch.Generator,
):
    """``k`` (score, beam, token) extensions, chosen on the last stage and shared (fewer when
    sampling leaves fewer tokens; padded with -inf scores)."""
    vals = torch.full((k,), float("-inf"))
    flat = torch.zeros(k, dtype=torch.int64)
    if logits is not None:
        logits = logits.float()
        got_vals, got_flat = _pick(
            scores[:, None] + logits.log_softmax(dim=-1), logits, scores, k, params, gen
        )
        vals[: len(got_vals)], flat[: len(got_flat)] = got_vals, got_flat
    vals, flat = share(vals), share(flat)
    return vals, flat // n, flat % n


@torch.inference_mode()
def beam_search(
    model: list[torch.nn.Module],
    prompt: Sequence[int],
    req: Request,
    beams: int,
    length_penalty: float = 1.0,
) -> list[int]:
    """The best hypothesis' new tokens (identical on every rank)."""
    batch = Batch.left_padded([prompt] * beams, req.pad_id)
    steps = token_budget(batch.tokens.shape[1], req)
    stepper = Stepper(model, batch, batch.tokens.shape[1] + steps, req.use_kv_cache, req.vocab_size)
    scores = torch.full((beams,), float("-inf"))
    scores[0] = 0.0  # identical beams at the start: extend only the first
    gen = torch.Generator().manual_seed(req.seed)
    live: list[list[int]] = [[] for _ in range(beams)]
    finished: list[tuple[float, list[int]]] = []
    for step in range(steps):
        logits = stepper.logits()
        n = logits.shape[-1] if logits is not None else 0
        n = int(share(torch.tensor([n]))[0])
        vals, rows, toks = _candidates(logits, scores, 2 * beams, n, req.params, gen)
        keep_rows, keep_toks, keep_scores = [], [], []
        for v, r, t in zip(vals.tolist(), rows.tolist(), toks.tolist(), strict=True):
            if v == float("-inf"):  # sampling left fewer candidates
                break
            if t in req.eos_ids:
                seq = live[r] + [t]
                finished.append((v / len(seq) ** length_penalty, seq))
            else:
                keep_rows.append(r), keep_toks.append(t), keep_scores.append(v)
            if len(keep_rows) == beams:
                break
        finished.sort(key=lambda f: -f[0])
        del finished[beams:]
        if not keep_rows:
            break
        while len(keep_rows) < beams:  # keep the batch size: dead copies of the best beam
            keep_rows.append(keep_rows[0]), keep_toks.append(keep_toks[0])
            keep_scores.append(float("-inf"))
        best_live = keep_scores[0] / (step + 1) ** length_penalty
        if len(finished) == beams and best_live <= finished[-1][0]:
            break
        rows_t = torch.tensor(keep_rows)
        live = [live[r] + [t] for r, t in zip(keep_rows, keep_toks, strict=True)]
        scores = torch.tensor(keep_scores)
        stepper.reorder(rows_t)
        stepper.append(torch.tensor(keep_toks))
    pool = finished + [
        (s / max(len(b), 1) ** length_penalty, b)
        for s, b in zip(scores.tolist(), live, strict=True)
    ]
    return max(pool, key=lambda f: f[0])[1]
