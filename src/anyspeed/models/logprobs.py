"""The one per-token log-probability forward: the labels' log-probabilities through Megatron's
vocab-parallel cross-entropy, at any TP/SP/CP, with gradients. Used by SFT, by reference and
old-policy passes, and by ``anyspeed evaluate``'s likelihood scoring."""

from __future__ import annotations

from typing import Any

import torch


def _core(model: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(model, "post_process") and hasattr(model, "module"):
        model = model.module
    return model


def token_logprobs(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """log p(labels[b, s] | tokens[b, :s+1]) as [b, s] (fp32) on a chunk that ends the
    pipeline; on an earlier chunk, its output (hidden states for the next stage).

    ``vocab_size``: the real vocabulary; the embedding's padded rows are then excluded from the
    normaliser (as a Hugging Face model without them would), else all rows count, as in
    Megatron's training loss. ``temperature`` divides the logits first (a sampling policy's
    distribution). ``entropy``: [2, b, s], the log-probs and each position's entropy (a
    metric, computed without a graph, unless ``entropy_grad``: a loss term).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    out = model(tokens, position_ids, attention_mask, packed_seq_params=packed_seq_params, **kwargs)
    if not _core(model).post_process:
        return out
    logits = out.float()  # [b, s, vocab / TP]
    if temperature != 1.0:
        logits = logits / temperature
    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if vocab_size is not None and start + local > vocab_size:
        cols = torch.arange(start, start + local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))
    if not entropy:
        return -vocab_parallel_cross_entropy(logits, labels.to(logits.device))
    # Megatron's cross-entropy works in place on its input: the entropy is computed first, and
    # when it takes part in the loss its graph keeps its own copy of the logits.
    if entropy_grad:
        ent = vocab_parallel_entropy(logits)
        logits = logits.clone()
    else:
        with torch.no_grad():
            ent = vocab_parallel_entropy(logits)
    logp = -vocab_parallel_cross_entropy(logits, labels.to(logits.device))
    return torch.stack([logp, ent])


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of softmax(logits) per position from this rank's vocabulary shard
    [..., vocab / TP] (rows at -inf left out), with gradients: the shards' sums are
    all-reduced over the tensor-parallel group (identity backward: each rank's loss is the
    same total)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    top = logits.detach().amax(-1, keepdim=True)
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - top
    e = torch.exp(shifted)
    finite = torch.isfinite(shifted)
    parts = torch.stack([e.sum(-1), (e * shifted.masked_fill(~finite, 0)).sum(-1)])
    if ps.get_tensor_model_parallel_world_size() > 1:
        parts = reduce_from_tensor_model_parallel_region(parts)
    total, weighted = parts[0], parts[1]
    return torch.log(total) - weighted / total


def packed_params(batch: dict[str, Any]) -> Any:
    """Megatron's ``thd`` PackedSeqParams of a packed micro-batch; None for a padded one."""
    if "cu_seqlens" not in batch:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch["cu_seqlens"]
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
