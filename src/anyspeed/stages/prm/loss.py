"""The process reward model's loss: at each step's placeholder token, cross-entropy of the step's
label token, over the ``--reward-tokens`` logits only (MindSpeed-LLM's and Math-Shepherd's
hard-label form) or, without them, over the whole vocabulary; and whether the likeliest
candidate is the label (the step accuracy)."""

from __future__ import annotations

import torch


def step_terms(
    logits: torch.Tensor, labels: torch.Tensor, reward_ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per position, 1.0 where the likeliest candidate is the label) from a last stage's
    fp32 logits [b, s, vocab / TP] and label token ids [b, s] (any id at unlabelled
    positions: the caller masks them)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from anyspeed.models.logprobs import vocab_parallel_logits_at, vocab_parallel_topk

    labels = labels.to(logits.device)
    if not reward_ids:
        with torch.no_grad():
            best = vocab_parallel_topk(logits, 1)[..., 0]
        # Megatron's cross-entropy works in place on its input.
        loss = vocab_parallel_cross_entropy(logits.clone(), labels)
        return loss, (best == labels).float()
    picked = vocab_parallel_logits_at(logits, list(reward_ids))  # [b, s, k]
    ids = torch.tensor(reward_ids, device=labels.device)
    index = (labels[..., None] == ids).long().argmax(-1)  # the label's place among the ids
    logp = torch.log_softmax(picked, -1)
    loss = -logp.gather(-1, index[..., None])[..., 0]
    return loss, (picked.detach().argmax(-1) == index).float()
