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
    at: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """log p(labels[b, s] | tokens[b, :s+1]) as [b, s] (fp32) on a chunk that ends the
    pipeline; on an earlier chunk, its output (hidden states for the next stage).

    ``vocab_size``: the real vocabulary; the embedding's padded rows are then excluded from the
    normaliser (as a Hugging Face model without them would), else all rows count, as in
    Megatron's training loss. ``temperature`` divides the logits first (a sampling policy's
    distribution). ``entropy``: [2, b, s], the log-probs and each position's entropy (a
    metric, computed without a graph, unless ``entropy_grad``: a loss term). ``at`` (token ids
    [b, s, k], with ``entropy``): [2 + k, b, s], then the log-probs of those ids too (with
    gradients: a distillation loss over a teacher's top-k).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    out = model(tokens, position_ids, attention_mask, packed_seq_params=packed_seq_params, **kwargs)
    if not _core(model).post_process:
        return out
    logits = prepared_logits(out, vocab_size, temperature)
    if not entropy:
        return -vocab_parallel_cross_entropy(logits, labels.to(logits.device))
    # Megatron's cross-entropy works in place on its input: the entropy (and the log-probs at
    # ``at``) are computed first, and when they take part in the loss their graph keeps its own
    # copy of the logits.
    if entropy_grad:
        ent = vocab_parallel_entropy(logits)
    else:
        with torch.no_grad():
            ent = vocab_parallel_entropy(logits)
    picked = vocab_parallel_logprobs_at(logits, at) if at is not None else None
    if entropy_grad or picked is not None:
        logits = logits.clone()
    logp = -vocab_parallel_cross_entropy(logits, labels.to(logits.device))
    both = torch.stack([logp, ent])
    return both if picked is None else torch.cat([both, picked.permute(2, 0, 1)])


def prepared_logits(
    out: torch.Tensor, vocab_size: int | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """A last stage's output [b, s, vocab / TP] as fp32 logits of the sampling distribution:
    divided by ``temperature``, the embedding's padded rows past ``vocab_size`` at -inf."""
    from megatron.core import parallel_state as ps

    logits = out.float()
    if temperature != 1.0:
        logits = logits / temperature
    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if vocab_size is not None and start + local > vocab_size:
        cols = torch.arange(start, start + local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))
    return logits


def vocab_parallel_logprobs_at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) at token ids [..., k] (global ids) from this rank's vocabulary
    shard [..., vocab / TP], with gradients: the normaliser's and the picked logits' shard
    sums are all-reduced (identity backward: each rank's loss is the same total)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    tp = ps.get_tensor_model_parallel_world_size()
    part = logits.shape[-1]
    top = logits.detach().amax(-1, keepdim=True)
    if tp > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    local = ids.to(logits.device) - ps.get_tensor_model_parallel_rank() * part
    inside = (local >= 0) & (local < part)
    picked = logits.gather(-1, local.clamp(0, part - 1))
    sumexp = torch.exp(logits - top).sum(-1, keepdim=True)
    parts = torch.cat([sumexp, torch.where(inside, picked - top, 0.0)], -1)
    if tp > 1:
        parts = reduce_from_tensor_model_parallel_region(parts)
    return parts[..., 1:] - torch.log(parts[..., :1])


def vocab_parallel_logits_at(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The logits [..., k] of global token ids ``ids`` from this rank's vocabulary shard
    [..., vocab / TP], with gradients: each id's column comes from the rank that holds it
    (all-reduced; identity backward, each rank's loss is the same total)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    part = logits.shape[-1]
    local = torch.tensor(ids, device=logits.device) - ps.get_tensor_model_parallel_rank() * part
    inside = (local >= 0) & (local < part)
    picked = torch.where(inside, logits[..., local.clamp(0, part - 1)], 0.0)
    if ps.get_tensor_model_parallel_world_size() > 1:
        picked = reduce_from_tensor_model_parallel_region(picked)
    return picked


def vocab_parallel_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The global ids [..., k] of the ``k`` largest logits over every rank's vocabulary shard
    (in descending order), the same on every rank of the tensor-parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, part = ps.get_tensor_model_parallel_world_size(), logits.shape[-1]
    vals, idx = logits.detach().topk(min(k, part), dim=-1)
    idx = idx + ps.get_tensor_model_parallel_rank() * part
    if tp > 1:
        group = ps.get_tensor_model_parallel_group()
        all_vals, all_idx = (
            [torch.empty_like(vals) for _ in range(tp)],
            [torch.empty_like(idx) for _ in range(tp)],
        )
        dist.all_gather(all_vals, vals.contiguous(), group=group)
        dist.all_gather(all_idx, idx.contiguous(), group=group)
        vals, idx = torch.cat(all_vals, -1), torch.cat(all_idx, -1)
    best = vals.topk(min(k, vals.shape[-1]), dim=-1).indices
    return idx.gather(-1, best)


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
