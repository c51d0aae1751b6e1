"""PPO's critic: a second model of the run at the training layout, in the same processes, with
its own optimizer and learning-rate schedule: the policy's architecture with a scalar value
head per token (ORM's reward head, read at every position), trained on the clipped value loss.

It starts from ``--critic-load`` (an ``--stage orm`` reward model or a critic checkpoint, its
head included) or from the policy's own start with a new head, and is saved inside each of the
policy's checkpoints (``iter_N/critic/``, written before the checkpoint is renamed into place,
so a checkpoint has both or neither); a resumed run resumes it with its optimizer.

Under LoRA the critic has adapters of its own (the policy's targets, rank and alpha) and trains
them with its head; its base weights are frozen, and its checkpoint holds the adapters and the
head, as the policy's holds its adapters. A LoRA run resumes both from ``--lora-load``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.stages.common.losses import cp_sum, per_token_loss
from anyspeed.stages.common.rl import objective as L
from anyspeed.stages.ppo import loss as P
from anyspeed.training.loop import Hook
from anyspeed.training.packed_rows import model_inputs, to_rows
from anyspeed.training.task import LossFunc, Task

if TYPE_CHECKING:
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run

METRICS = ("critic/vpred_mean", "critic/vf_clipfrac")
SUBDIR = "critic"  # inside a policy checkpoint's iteration directory


class CriticTask(Task):
    """The value loss of a micro-batch holding ``values`` (old) and ``returns`` per token."""

    name, loss_key = "critic", "critic/vf_loss"
    metrics = METRICS

    def __init__(
        self, clip: float, agg: str, max_response: int, lora: Any = None, packed: Any = None
    ) -> None:
        self.clip, self.agg, self.max_response, self.packed = clip, agg, max_response, packed
        self.lora = critic_lora(lora)
        self.lora_cfg = lora  # the policy's LoRA: where a LoRA run resumes from

    def transforms(self) -> list[Any]:
        from anyspeed.models.reward_head import reward_head
        from anyspeed.stages.common.reference import packed_transforms

        # the head first: LoRA then freezes all but its adapters and the head
        lora = [self.lora.transform()] if self.lora else []
        return [per_token_loss, reward_head, *packed_transforms(self.packed), *lora]

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        b = next(data_iterator)
        out = _values(model, b)

        def loss_func(output: torch.Tensor) -> tuple:
            return self.value_loss(to_rows(output[..., 0].float(), b), b)

        return out, loss_func

    def value_loss(self, vpred: torch.Tensor, b: dict) -> tuple:
        """(sum, count, metrics): ½·max((V − G)², (clip(V) − G)²) under the aggregation."""
        mask = b["loss_mask"].float()
        t = P.value_loss(vpred, b["values"], b["returns"], self.clip)
        seq = cp_sum(torch.stack([(t["vf"] * mask).sum(-1), mask.sum(-1)]))
        total, count = L.aggregate(seq[0], seq[1], self.agg, self.max_response)
        n = mask.sum().double()

        def mean(x: torch.Tensor) -> torch.Tensor:
            return torch.stack([(x.detach().double() * mask).sum(), n])

        metrics = {
            self.loss_key: torch.stack([total.detach().double(), count.double()]),
            "critic/vpred_mean": mean(vpred),
            "critic/vf_clipfrac": mean(t["clipped"]),
        }
        return total, count.round().to(torch.int), metrics


def _values(model: torch.nn.Module, b: dict) -> torch.Tensor:
    """The critic's output for micro-batch ``b`` (its packed sequence when it has one)."""
    tokens, pos, _, packed = model_inputs(b)
    return model(tokens, pos, None, packed_seq_params=packed)


def critic_lora(lora: Any) -> Any:
    """The critic's LoRA: the policy's adapters on its own model, its head trained and saved
    with them (None without LoRA)."""
    if lora is None:
        return None
    return dataclasses.replace(lora, modules_to_save=(*lora.modules_to_save, "output_layer"))


class Critic:
    """The critic's model, optimizer and schedule on this rank (groups already started)."""

    def __init__(self, run: Run, rl: Any, lr: float) -> None:
        from anyspeed.training.engine import build_scheduler
        from anyspeed.training.step import Trainer

        cfg = dataclasses.replace(run.train, lr=lr, min_lr=min(run.train.min_lr, lr))
        x = rl.extra
        self.task = CriticTask(x.cliprange_value, rl.agg, rl.max_response, rl.lora, rl.packing)
        self.trainer = Trainer(run.model, run.layout, cfg, self.task, start_groups=False)
        args = argparse.Namespace(**{**vars(run.args), "lr": lr, "min_lr": cfg.min_lr})
        self.scheduler = build_scheduler(self.trainer.optimizer, types.SimpleNamespace(args=args))
        self.gbs = run.args.global_batch_size

    def start(self, run: Run, load: str | None) -> None:
        """Resume from the policy checkpoint's critic when the run resumes; else the weights
        of ``load`` (with its head when it has one) or of the policy's start (a new head).
        Under LoRA the weights come first, then the adapters, head and optimizer resume."""
        from anyspeed.checkpoint.load import load_checkpoint
        from anyspeed.stages.common.value_head import has_head
        from anyspeed.training.lora import set_view

        model, opt = self.trainer.model, self.trainer.optimizer
        resumed = self._resume_dir(run)
        source = load or run.load
        if resumed is None or self.task.lora:
            if source is not None:
                keep = () if has_head(source) else ("output_layer.",)
                if self.task.lora:
                    set_view(model, "weights")
                load_checkpoint(source, model, None, None, finetune=True, load_rng=False, keep=keep)
            if self.task.lora:
                set_view(model, "adapters")
        if resumed is not None:
            load_checkpoint(resumed, model, opt, self.scheduler)

    def _resume_dir(self, run: Run) -> str | None:
        """The critic inside the checkpoint the policy resumes from; None: a new start."""
        from anyspeed.stages.common.lora_start import resumed_dir

        at = resumed_dir(self.task.lora_cfg, run)
        if at is not None and os.path.isdir(os.path.join(at, SUBDIR)):
            return os.path.join(at, SUBDIR)
        return None

    def values(self, micro: list[dict[str, Any]]) -> list[torch.Tensor] | None:
        """[b, s] values per micro-batch on the last pipeline stage (None elsewhere)."""
        from anyspeed.training.logprob_pass import output_pass
        from anyspeed.training.model_pipeline import eval_mode, unwrap

        def compute(model: torch.nn.Module, b: dict) -> torch.Tensor:
            out = _values(model, b)
            # the last stage's [b, s, 1] values; a stage before it sends on its hidden states
            return to_rows(out[..., 0].float(), b) if unwrap(model).post_process else out

        with torch.no_grad(), eval_mode(self.trainer.model):
            return output_pass(self.trainer, self.trainer.model, micro, compute)

    def step(self, micro: list[dict[str, Any]]) -> dict[str, float]:
        """One critic optimizer step: its loss, grad norm and metrics."""
        out = self.trainer.step(micro)
        self.scheduler.step(increment=self.gbs)
        return {
            "critic/vf_loss": out["loss"],
            "critic/grad_norm": out["grad_norm"],
            **out["metrics"],
        }

    def save(self, root: str, iteration: int) -> None:
        from anyspeed.checkpoint.save import save_checkpoint

        t = self.trainer
        save_checkpoint(root, iteration, t.model, t.optimizer, self.scheduler, {}, save_rng=False)


class SaveCritic(Hook):
    """Writes the critic into each policy checkpoint before it is renamed into place."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def on_checkpoint_written(self, state: LoopState, tmp_dir: str) -> None:
        self.owner.critic.save(os.path.join(tmp_dir, SUBDIR), state.iteration)
