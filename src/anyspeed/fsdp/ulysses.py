"""Ulysses sequence parallelism for transformers models: an attention function registered
with transformers' ``AttentionInterface`` that trades sequence shards for head shards around
causal attention (anyspeed's :func:`~anyspeed.features.context_parallel.ulysses.
ulysses_attention`), so each rank of a group runs the model on its part of the sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from anyspeed.errors import UsageError

NAME = "anyspeed_ulysses"
_GROUP: list[Any] = [None]


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention of this rank's sequence shard (q [b, h, s/u, d]) over the whole
    sequence; transformers' layout out ([b, s/u, h, d])."""
    from anyspeed.features.context_parallel.ulysses import ulysses_attention

    if kwargs.get("sliding_window"):
        raise RuntimeError("Ulysses attention has no sliding window")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ulysses_attention(query, key, value, scale, _GROUP[0])
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Ulysses attention is causal over the gathered sequence: transformers builds no mask."""
    return None


def check(config: Any, cp: int) -> None:
    """UsageError (one line) when the model's attention cannot be split ``cp`` ways: heads
    not divisible, or sliding-window layers."""
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_attention_heads", 0)
    if not heads or heads % cp:
        raise UsageError(
            f"parallel.cp_size {cp} does not divide the model's {heads} attention heads"
        )
    kinds = set(getattr(text, "layer_types", None) or ())
    if "sliding_attention" in kinds or getattr(text, "use_sliding_window", False):
        raise UsageError(
            "parallel.cp_size > 1: the model has sliding-window attention layers, which "
            "Ulysses attention does not reproduce; use cp_size 1"
        )
    if kinds - {"full_attention"}:
        raise UsageError(
            f"parallel.cp_size > 1: the model has {sorted(kinds - {'full_attention'})} layers; "
            "Ulysses covers full attention only"
        )


def install(model: torch.nn.Module, group: Any) -> None:
    """Route every attention layer of ``model`` through Ulysses over ``group``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _GROUP[0] = group
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    model.set_attn_implementation(NAME)
