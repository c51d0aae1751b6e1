"""One new query per row attending over a static KV cache (the lean decode step's core)."""

from __future__ import annotations

from typing import Any

import torch

from anyspeed.features.inference import replay


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softmax_fp32: bool,
    softmax: Any = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row over ``n`` cached slots: q [b, g, per_group, d], keys / values
    [n, b, g, d] (views of the cache) -> [b, g * per_group * d]; each query group shares its
    key/value head without repeating it. ``mask`` [b, 1, 1, >= n] hides True slots; the
    pre-hooks of the core's ``softmax`` module see the scaled scores (:mod:`.replay`); ``sink``
    [heads]: a logit per head for "none of the keys" in the softmax (GPT-OSS), dropped after.

    (torch's fused ``scaled_dot_product_attention`` was tried here: faster only for caches of
    under ~100 slots, up to 2x slower at 1,000 slots or batch 64 on a CPU.) The scale is applied
    inside the first product, as Megatron's own attention applies it (``baddbmm``'s alpha)."""
    b, g, p, d = q.shape
    n = keys.shape[0]
    # [b * g, d, n] and [b * g, n, d]: views, as b and g merge in either order of the cache
    kt = keys.permute(1, 2, 3, 0).reshape(b * g, d, n)
    vs = values.permute(1, 2, 0, 3).reshape(b * g, n, d)
    empty = kt.new_empty(())  # beta=0: not read
    scores = torch.baddbmm(empty, q.reshape(b * g, p, d), kt, beta=0.0, alpha=scale)
    scores = replay.scores(softmax, scores)  # e.g. Gemma 2's soft-cap
    if mask is not None:
        scores = scores.view(b, g, p, n).masked_fill(mask[..., :n], float("-inf"))
    if sink is not None:  # a softmax over the keys and the head's sink logit, which is dropped
        if softmax_fp32:
            scores = scores.float()
        sinks = sink.view(1, g, p, 1).to(scores.dtype).expand(b, g, p, 1)
        both = torch.cat((scores.view(b, g, p, n), sinks), dim=-1)
        probs = torch.softmax(both, dim=-1)[..., :-1].to(q.dtype)
    elif softmax_fp32 and scores.dtype != torch.float32:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs.view(b * g, p, n), vs).view(b, -1)
