"""Pretraining: next-token prediction on Megatron's GPT datasets (or mock/synthetic tokens)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.training.task import LossFunc, StagePlan, Task

if TYPE_CHECKING:
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer


def lm_loss(losses: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """This rank's share of the micro-batch's mean token loss.

    Each context-parallel rank holds 1/CP of every sequence and Megatron sums gradients over
    the CP group, so the shares are scaled for their sum to be the global mean.
    """
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    losses = losses.float()
    if loss_mask is None:
        return losses.mean() / cp
    mask = loss_mask.float().view(-1)
    count = mask.sum()
    if cp > 1:
        count = count.clone()
        torch.distributed.all_reduce(count, group=ps.get_context_parallel_group())
    return (losses.view(-1) * mask).sum() / count.clamp(min=1.0)


class PretrainTask(Task):
    """Causal language modelling on tokens/labels/position_ids batches."""

    name = "pretrain"

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        batch = next(data_iterator)
        loss_mask = batch.get("loss_mask")
        # the loss mask reaches the model for the multi-token prediction loss
        output = model(
            batch["tokens"],
            batch["position_ids"],
            batch.get("attention_mask"),
            labels=batch["labels"],
            loss_mask=loss_mask,
        )

        def loss_func(output_tensor: torch.Tensor):
            loss = lm_loss(output_tensor, loss_mask)
            return loss, {self.loss_key: loss.detach().clone()}

        return output, loss_func

    def datasets(self, run: Run) -> list[Any]:
        """(train, valid, test) datasets of a checked run; None for an empty split."""
        from anyspeed.stages.common.gpt_data import build_datasets

        return build_datasets(run.args, run.tokenizer)

    def batches(
        self,
        dataset: Any,
        run: Run,
        consumed: int,
        device: torch.device,
        trainer: Trainer | None = None,
    ) -> Iterator[list[dict[str, torch.Tensor]]]:
        """This rank's micro-batches of each next global batch, from ``consumed`` on."""
        from anyspeed.stages.common.gpt_data import batches

        return batches(dataset, run.args, consumed, device)


def plan(args: argparse.Namespace) -> StagePlan:
    """The pretraining stage's data: --data-path's prefixes (checked), or mock tokens."""
    from anyspeed.stages.checks import gpt_data_prefixes

    return StagePlan(data_prefixes=gpt_data_prefixes(args))


def make_task(run: Run) -> PretrainTask:
    return PretrainTask()
