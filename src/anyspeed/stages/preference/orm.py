"""The outcome reward model (``--stage orm``): a scalar head at each sequence's last token,
trained on pairwise data with -log σ(s_chosen - s_rejected), the mean over the global batch's
pairs (the same at every layout).

The model is the language model with its output layer replaced by
:class:`anyspeed.models.reward_head.RewardHead`. Started from a language-model checkpoint
(SFT, pretraining, or an HF directory) the body's weights are loaded and the head starts fresh;
an ORM checkpoint resumes whole. ``anyspeed convert`` exports it as transformers'
``*ForSequenceClassification`` with one label.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.errors import UsageError
from anyspeed.stages.common.value_head import has_head, last_token
from anyspeed.stages.preference import loss as P
from anyspeed.stages.preference.task import PreferenceTask
from anyspeed.training.packed_rows import model_inputs, to_rows
from anyspeed.training.task import LossFunc, StagePlan

if TYPE_CHECKING:
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def plan(args: argparse.Namespace) -> StagePlan:
    """The pairwise data checks of DPO, and what a reward model cannot do here."""
    from anyspeed.stages.preference import task as preference

    if args.lora_target_modules:
        raise UsageError(
            "--stage orm trains the whole model and its head; drop --lora-target-modules"
        )
    if args.context_parallel_size > 1:
        raise UsageError(
            "--stage orm with --context-parallel-size > 1 is not supported (the "
            "score is read at each sequence's last token); use CP 1"
        )
    return preference.plan(args, "orm")


def make_task(run: Run) -> ORMTask:
    """The reward-model task of a checked run."""
    return ORMTask(run.config)


class ORMTask(PreferenceTask):
    """Pairs ([chosen rows; rejected rows]) scored by the reward head."""

    metrics = METRICS

    def transforms(self) -> list[Any]:
        from anyspeed.models.reward_head import reward_head

        return [*super().transforms(), reward_head]

    def frozen_models(self) -> dict[str, Any]:
        return {}

    def records(self) -> dict[str, Any]:
        return {"anyspeed_reward_model": {"num_labels": 1}}

    def load(self, run: Run, trainer: Trainer, scheduler: Any, state: LoopState) -> bool:
        """From a language-model checkpoint: its body, a fresh head (False: an ORM checkpoint,
        resumed or fine-tuned by the engine)."""
        from anyspeed.checkpoint.load import load_checkpoint

        if not run.load or has_head(run.load):
            return False
        load_checkpoint(
            run.load,
            trainer.model,
            None,
            None,
            finetune=True,
            load_rng=False,
            keep=("output_layer.",),
        )
        return True

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        batch = next(data_iterator)
        tokens, pos, _, packed = model_inputs(batch)
        output = model(tokens, pos, None, packed_seq_params=packed)
        mask = batch["loss_mask"]

        def loss_func(scores: torch.Tensor):
            # a packed micro-batch's scores [1, T, 1] back in its rows [2m, s, 1]
            return self.score_loss(to_rows(scores, batch, dim=1), mask)

        return output, loss_func

    def score_loss(self, scores: torch.Tensor, mask: torch.Tensor) -> tuple:
        """(sum of the pair losses, pair count, metrics) from [2m, s, 1] per-token scores."""
        at = last_token(mask)
        s = scores[..., 0].float().gather(1, at[:, None])[:, 0]
        m = s.shape[0] // 2
        losses, rc, rr = P.orm_loss(s[:m], s[m:])
        total = losses.sum()
        metrics = P.pair_metrics(rc, rr, None)
        n = torch.tensor(float(m), dtype=torch.float64, device=total.device)
        metrics[self.loss_key] = torch.stack([total.detach().double(), n])
        return total, torch.tensor(m, dtype=torch.int, device=total.device), metrics

    def batches(
        self,
        dataset: Any,
        run: Run,
        consumed: int,
        device: torch.device,
        trainer: Trainer | None = None,
    ) -> Iterator[list[dict[str, torch.Tensor]]]:
        from anyspeed.stages.preference.data import batches

        data, rows = dataset
        return batches(data, run.args, rows, consumed, device, self.cfg)
