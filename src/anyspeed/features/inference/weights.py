"""Part of ``no-grad-fast-path`` on the CPU: a model loaded only to generate or score keeps
each linear weight in its transpose's memory order (``w.t().contiguous().t()``: the same
values and shape, strides ``(1, out)``), so ``x @ w.t()`` multiplies by a contiguous
``[in, out]`` matrix.

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


def transpose_for_decode(chunks: list[Any]) -> int:
    """Store the linear weights of ``chunks`` (GPT models of plain layers, float32) in
    transposed memory order, one weight at a time; the number moved (0 when a chunk is of
    another kind)."""
    from anyspeed.features.inference.decode_step import plan_of

    moved = 0
    for chunk in chunks:
        plan = plan_of(chunk) if hasattr(chunk, "decoder") else None
        if plan is None or any(lay.fc1 is None or lay.qkv is None for lay in plan.layers):
            continue
        with torch.no_grad():
            for w in _linear_weights(chunk):
                if w.dtype == torch.float32 and w.is_contiguous():
                    w.data = w.data.t().contiguous().t()
                    moved += 1
    return moved
