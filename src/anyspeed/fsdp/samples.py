"""A training sample of ``anyspeed fsdp2`` (input tokens, next-token targets, image tensors)
and the right-padded micro-batch several of them make."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

IGNORE = -100


@dataclass
class Sample:
    input_ids: list[int]
    targets: list[int]  # next-token targets, IGNORE where the loss does not look
    extra: dict[str, Any] = field(default_factory=dict)  # image tensors, joined along dim 0
    per_token: dict[str, list[int]] = field(default_factory=dict)  # e.g. mm_token_type_ids


def collate(samples: list[Sample], multiple: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``labels`` (length a multiple of ``multiple``), the padding
    mask (when there is padding), and the samples' image tensors joined along their first
    dimension."""
    longest = max(len(s.input_ids) for s in samples)
    longest = -(-longest // multiple) * multiple
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for r, s in enumerate(samples):
        n = len(s.input_ids)
        ids[r, :n] = torch.tensor(s.input_ids)
        labels[r, :n] = torch.tensor(s.targets)
        mask[r, :n] = 1
    batch = {"input_ids": ids, "labels": labels}
    if not bool(mask.all()):  # without padding the causal mask says it all: SDPA's fused kernel
        batch["attention_mask"] = mask
    for key in samples[0].per_token:
        batch[key] = torch.zeros(len(samples), longest, dtype=torch.long)
        for r, s in enumerate(samples):
            batch[key][r, : len(s.per_token[key])] = torch.tensor(s.per_token[key])
    for key in {k for s in samples for k in s.extra}:
        parts = [s.extra[key] for s in samples if key in s.extra]
        batch[key] = torch.cat(parts, dim=0)
    return batch
