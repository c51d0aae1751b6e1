"""The task interface the training step drives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

LossFunc = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Task:
    """Supplies the forward step and loss for Megatron's schedules (and, for a command, the
    data). ``forward_step`` follows Megatron's contract: ``(data_iterator, model) ->
    (output, loss_func)``, where ``loss_func(output) -> (loss, {"lm loss": value})``."""

    name: str = "task"
    loss_key: str = "lm loss"

    def forward_step(self, data_iterator: Iterator[dict[str, Any]],
                     model: torch.nn.Module) -> tuple[torch.Tensor, LossFunc]:  # fmt: skip
        raise NotImplementedError

    def transforms(self) -> list[Any]:
        """Model transforms the task needs (applied before the caller's, before DDP)."""
        return []

    def schedule_shape(self, seq_length: int, micro_batch_size: int) -> tuple[int, int]:
        """(sequence length, micro-batch size) of the tensors pipeline stages exchange."""
        return seq_length, micro_batch_size
