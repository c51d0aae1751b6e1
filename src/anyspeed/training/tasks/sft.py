"""Supervised fine-tuning: response tokens only, one global token mean per global batch.

The loss function hands Megatron's schedule (token-loss sum, token count); with the config's
``calculate_per_token_loss`` Megatron sums gradients over micro-batches and data/context
replicas and divides by the global count, so the loss is the mean over every response token of
the global batch at any TP/PP/CP/DP layout (never a mean of per-sample or per-micro-batch means).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import torch

from anyspeed.models.config import ModelConfig
from anyspeed.training.tasks.base import LossFunc, Task


def token_loss(losses: torch.Tensor, mask: torch.Tensor):
    """(sum of masked token losses, token count, {"lm loss": [sum, count]}) of one micro-batch
    (this rank's share of it under context parallelism)."""
    mask = mask.reshape(-1).float()
    total = (losses.float().reshape(-1) * mask).sum()
    count = mask.sum()
    return total, count.to(torch.int), torch.stack([total.detach(), count.detach()])


def _per_token_loss(chunk: torch.nn.Module, model: ModelConfig) -> torch.nn.Module:
    chunk.config.calculate_per_token_loss = True  # gradients / global token count
    return chunk


def _unfused_rope(chunk: torch.nn.Module, model: ModelConfig) -> torch.nn.Module:
    # Megatron's fused RoPE seam has no ``thd`` (packed) form on this device; its unfused
    # path restarts the rotary positions at every cu_seqlens boundary.
    chunk.config.apply_rope_fusion = False
    return chunk


class SFTTask(Task):
    """Instruction tuning on padded samples or packed (``thd``) sequences."""

    name = "sft"

    def __init__(self, packed: bool = False) -> None:
        self.packed = packed

    def transforms(self) -> list[Any]:
        return [_per_token_loss, _unfused_rope] if self.packed else [_per_token_loss]

    def schedule_shape(self, seq_length: int, micro_batch_size: int) -> tuple[int, int]:
        # A packed micro-batch is one sequence of all its rows' tokens.
        if self.packed:
            return seq_length * micro_batch_size, 1
        return seq_length, micro_batch_size

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        batch = next(data_iterator)
        packed = None
        if "cu_seqlens" in batch:
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = batch["cu_seqlens"]
            longest = int((cu[1:] - cu[:-1]).max())
            packed = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=longest,
                max_seqlen_kv=longest,
            )
        output = model(
            batch["tokens"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            packed_seq_params=packed,
        )
        mask = batch["loss_mask"]

        def loss_func(output_tensor: torch.Tensor):
            total, count, report = token_loss(output_tensor, mask)
            return total, count, {self.loss_key: report}

        return output, loss_func

    def datasets(self, args: argparse.Namespace) -> list[Any]:
        """(train, valid, test): the instruction data with each split's row range (or None)."""
        from anyspeed.training.sft_data import open_data, split_rows

        data = open_data(args.sft_prefix, args.seq_length)
        return [None if r is None else (data, r) for r in split_rows(len(data), args.split)]

    def batches(
        self, dataset: Any, args: argparse.Namespace, consumed: int, device: torch.device
    ) -> Iterator[list[dict[str, torch.Tensor]]]:
        """This rank's micro-batches of each next global batch, from ``consumed`` on."""
        from anyspeed.training.sft_data import batches

        data, rows = dataset
        return batches(data, args, rows, consumed, device)
