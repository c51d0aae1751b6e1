"""Greedy text generation at any TP/PP/DP layout (the sample a pretraining run prints).

Each new token re-runs the whole prefix through the pipeline schedule (no KV cache): simple and
layout-agnostic, fine for the short samples a demo prints.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch


def generate_ids(
    model: list, prompt_ids: list[int], new_tokens: int, max_len: int, eod: int | None = None
) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (identical on every rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from anyspeed.device import torch_device
    from anyspeed.inference.logits import forward_logits

    tp = ps.get_tensor_model_parallel_world_size()
    ids = list(prompt_ids)
    for _ in range(new_tokens):
        window = ids[-max_len:]
        n = len(window)
        # Sequence parallelism splits the sequence over TP ranks: pad on the right (causal
        # attention keeps the padding from touching the positions we read).
        padded = window + [0] * ((-n) % tp)
        logits = forward_logits(model, torch.tensor([padded]))
        nxt = torch.zeros(1, dtype=torch.int64, device=torch_device())
        if logits is not None:
            nxt[0] = int(logits[0, n - 1].float().argmax())
        dist.all_reduce(nxt, op=dist.ReduceOp.MAX)  # the last stage's choice, on every rank
        token = int(nxt[0])
        ids.append(token)
        if eod is not None and token == eod:
            break
    return ids[len(prompt_ids) :]


def generate_text(
    model: list, args: argparse.Namespace, prompt: str, new_tokens: int, tok: Any = None
) -> str | None:
    """Greedy continuation of ``prompt`` decoded with the run's tokenizer (None without one)."""
    if tok is None or getattr(args, "context_parallel_size", 1) > 1:
        return None
    ids = tok.encode([prompt], special=False)[0]
    out = generate_ids(model, ids, new_tokens, args.seq_length, tok.eod_id)
    return decode(tok, out)


def decode(tok, ids: list[int]) -> str:
    """Text of ``ids`` through whichever backend the tokenizer wraps."""
    for attr in ("hf", "tok", "sp"):
        backend = getattr(tok, attr, None)
        if backend is not None:
            return backend.decode(ids)
    backend = getattr(tok, "backend", None)
    if backend is not None:
        return backend.decode(ids)
    return " ".join(map(str, ids))
