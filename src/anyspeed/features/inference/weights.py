"""Part of ``no-grad-fast-path`` on the CPU: a model loaded only to generate or score keeps
each linear weight in its transpose's memory order (``w.t().contiguous().t()``: the same
values and shape, strides ``(1, out)``), so ``x @ w.t()`` multiplies by a contiguous
``[in, out]`` matrix; products of several rows go through packed copies instead
(:mod:`anyspeed.features.inference.packed`).

A one-token decode step is a chain of matrix-vector products that stream every weight once.
With one thread, MKL's fp32 product streams a contiguous ``[in, out]`` matrix about 10% faster
than the ``[out, in]`` matrix Megatron keeps: 12.1 against 11.0 GB/s over SmolLM2-135M's layer
weights (``benchmarks/generate.py``, docs/inference.md). At batch 64 the two orders measured
the same. The products compute the same sums in the same order, so tokens do not change.

Only float32 weights of plain layers are moved (the lean decode step's kinds: no MoE block,
no multi-latent attention, whose modules view their weights in other shapes); the embedding
only when it is also the output layer's weight (a lookup reads rows, the output layer
columns). Never for training: optimizers and gradient buffers hold parameter views.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _linear_weights(chunk: Any) -> list[torch.nn.Parameter]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    out = []
    for m in chunk.modules():
        if isinstance(m, ColumnParallelLinear | RowParallelLinear):
            w = getattr(m, "weight", None)
            if isinstance(w, torch.nn.Parameter) and w.dim() == 2:
                out.append(w)
    if getattr(chunk, "share_embeddings_and_output_weights", False):
        shared = chunk.shared_embedding_or_output_weight()
        if shared is not None and all(shared is not w for w in out):
            out.append(shared)
    return out


def _plain(chunk: Any) -> bool:
    """Whether ``chunk`` is a GPT model whose layers the lean step runs from their weights
    (no MoE block, no multi-latent attention)."""
    from anyspeed.features.inference.decode_step import plan_of

    plan = plan_of(chunk) if hasattr(chunk, "decoder") else None
    if plan is None:
        return False
    return all(lay.fc1 is not None and lay.qkv is not None for lay in plan.layers)


def prepare_for_decode(chunks: list[Any]) -> str:
    """A model loaded only to generate or score: its weights in transposed order (one row's
    products), and the lean step's products of several rows through packed weights
    (:mod:`anyspeed.features.inference.packed`) where MKL has them and the copies fit in
    memory; "packed", "transposed" (no packing) or "" (a model of other layers)."""
    from anyspeed.features.inference import packed

    plain = [c for c in chunks if _plain(c)]
    moved = transpose_for_decode(plain)  # one row's products
    if plain and packed.enable(plain, decode_weights(plain)):
        return "packed"
    return "transposed" if moved else ""


def decode_weights(chunks: list[Any]) -> list[torch.Tensor]:
    """The linear weights the lean step multiplies by, when every chunk is a GPT model of
    plain layers; else none."""
    if not chunks or not all(_plain(c) for c in chunks):
        return []
    return [w for c in chunks for w in _linear_weights(c)]


def transpose_for_decode(chunks: list[Any]) -> int:
    """Store the linear weights of ``chunks`` (GPT models of plain layers, float32) in
    transposed memory order, one weight at a time; the number moved (0 when a chunk is of
    another kind)."""
    moved = 0
    for chunk in chunks:
        if not _plain(chunk):
            continue
        # not inference tensors, even when called under inference mode: those keep no version
        # counter, and packed copies follow a weight's changes by it
        with torch.inference_mode(False), torch.no_grad():
            for w in _linear_weights(chunk):
                if w.dtype == torch.float32 and w.is_contiguous():
                    w.data = w.data.t().contiguous().t()
                    moved += 1
    return moved


@contextlib.contextmanager
def packed_during(chunks: list[Any]) -> Iterator[None]:
    """Packed products for one rollout of a model being trained (plain fp32 layers on the CPU,
    when the copies fit): packed at its first step, freed when it ends, so the training steps
    around it keep their memory."""
    from anyspeed.features.inference import packed

    weights = decode_weights(chunks)
    on = bool(weights) and all(packed.of(c) is None for c in chunks)
    on = on and packed.enable(chunks, weights)
    try:
        yield
    finally:
        if on:
            packed.disable(chunks)
