"""Beam search over one prompt (``--task beam_search``), KV cache reordered with the beams.

The classic procedure: each step every live beam is extended by every token, the best
``2 * beams`` candidates (by summed log-probability) are walked in order, a candidate ending in
EOS becomes a finished hypothesis scored ``logp / length ** length_penalty``, the others refill
the live beams. It stops when ``beams`` hypotheses are finished and no live beam can beat the
worst of them, or at the token budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from anyspeed.inference.decode import Batch, Request, Stepper, _budget, share


def _candidates(logits: torch.Tensor | None, scores: torch.Tensor, k: int, n: int):
    """The best ``k`` (score, beam, token) extensions, chosen on the last stage and shared."""
    vals = torch.zeros(k, dtype=torch.float32)
    flat = torch.zeros(k, dtype=torch.int64)
    if logits is not None:
        total = scores[:, None] + logits.log_softmax(dim=-1)
        vals, flat = torch.topk(total.flatten(), k)
    vals, flat = share(vals), share(flat)
    return vals, flat // n, flat % n


@torch.inference_mode()
def beam_search(model: list[torch.nn.Module], prompt: Sequence[int], req: Request, beams: int,
                length_penalty: float = 1.0) -> list[int]:  # fmt: skip
    """The best hypothesis' new tokens (identical on every rank)."""
    batch = Batch.left_padded([prompt] * beams, req.pad_id)
    steps = _budget(batch.tokens.shape[1], req)
    stepper = Stepper(model, batch, batch.tokens.shape[1] + steps, req.use_kv_cache,
                      req.vocab_size)  # fmt: skip
    scores = torch.full((beams,), float("-inf"))
    scores[0] = 0.0  # identical beams at the start: extend only the first
    live: list[list[int]] = [[] for _ in range(beams)]
    finished: list[tuple[float, list[int]]] = []
    for step in range(steps):
        logits = stepper.logits()
        n = logits.shape[-1] if logits is not None else 0
        n = int(share(torch.tensor([n]))[0])
        vals, rows, toks = _candidates(logits, scores, 2 * beams, n)
        keep_rows, keep_toks, keep_scores = [], [], []
        for v, r, t in zip(vals.tolist(), rows.tolist(), toks.tolist(), strict=True):
            if t in req.eos_ids:
                seq = live[r] + [t]
                finished.append((v / len(seq) ** length_penalty, seq))
            else:
                keep_rows.append(r), keep_toks.append(t), keep_scores.append(v)
            if len(keep_rows) == beams:
                break
        finished.sort(key=lambda f: -f[0])
        del finished[beams:]
        best_live = keep_scores[0] / (step + 1) ** length_penalty
        if len(finished) == beams and best_live <= finished[-1][0]:
            break
        rows_t = torch.tensor(keep_rows)
        live = [live[r] + [t] for r, t in zip(keep_rows, keep_toks, strict=True)]
        scores = torch.tensor(keep_scores)
        stepper.reorder(rows_t)
        stepper.append(torch.tensor(keep_toks))
    pool = finished + [(s / max(len(b), 1) ** length_penalty, b)
                       for s, b in zip(scores.tolist(), live, strict=True)]  # fmt: skip
    return max(pool, key=lambda f: f[0])[1]
