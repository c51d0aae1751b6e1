"""One training step of ``anyspeed fsdp2``: micro-batches through the sharded model, the loss
as the mean over every learned token of the global batch, clipping, AdamW, the schedule.

FSDP2 averages gradients over all ranks; each rank's loss is its tokens' summed cross entropy
divided by the global batch's token count and multiplied by the number of ranks, so the update
is that of the whole batch in one process whatever the layout (data-parallel or Ulysses ranks).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from anyspeed.fsdp.config import TrainingSection
from anyspeed.fsdp.samples import IGNORE


class Schedule:
    """Linear warm-up, then constant, linear or cosine decay to ``min_lr`` over ``max_steps``;
    ``step(increment)`` as the loop calls Megatron's scheduler (the increment is unused: the
    schedule counts optimizer steps)."""

    def __init__(self, optimizer: torch.optim.Optimizer, t: TrainingSection) -> None:
        self.optimizer, self.t = optimizer, t
        self.warmup = int(t.warmup_ratio * t.max_steps)
        self.num_steps = 0
        self._apply()

    def lr(self, step: int) -> float:
        t = self.t
        if self.warmup and step < self.warmup:
            return t.lr * (step + 1) / self.warmup
        if t.lr_scheduler_type == "constant":
            return t.lr
        frac = min(1.0, (step - self.warmup) / max(1, t.max_steps - self.warmup))
        if t.lr_scheduler_type == "linear":
            return t.min_lr + (t.lr - t.min_lr) * (1 - frac)
        return t.min_lr + (t.lr - t.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(self.num_steps)

    def step(self, increment: int = 1) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()


def make_optimizer(model: torch.nn.Module, t: TrainingSection) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (decay on matrices only, as transformers' Trainer
    does: biases and norms keep their values)."""
    decay, keep = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else keep).append(p)
    groups = [{"params": decay, "weight_decay": t.weight_decay}]
    if keep:
        groups.append({"params": keep, "weight_decay": 0.0})
    return torch.optim.AdamW(
        groups,
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
        foreach=False,  # DTensor shards of several sizes: the per-parameter path
    )


class FSDPTrainer:
    """The sharded model, its optimizer and the step the loop calls."""

    def __init__(
        self, model: torch.nn.Module, t: TrainingSection, cp_group: Any, device: torch.device
    ) -> None:
        self.model, self.t, self.cp_group, self.device = model, t, cp_group, device
        self.optimizer = make_optimizer(model, t)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.iteration = 0

    def _inputs(self, mb: dict[str, torch.Tensor]) -> tuple[dict[str, Any], torch.Tensor]:
        """The model's keyword arguments and this rank's targets: with Ulysses, this rank's
        contiguous sequence shard, its global positions, and no padding mask (right padding
        under a causal mask leaves every learned token exact)."""
        mb = {k: v.to(self.device) for k, v in mb.items()}
        labels = mb.pop("labels")
        if self.cp_group is None:
            return mb, labels
        ids, cut = mb["input_ids"], self._shard(mb["input_ids"].shape[1])
        pos = torch.arange(ids.shape[1], device=self.device)[cut]
        inputs = {"input_ids": ids[:, cut], "position_ids": pos.unsqueeze(0).expand(len(ids), -1)}
        return inputs, labels[:, cut]

    def _shard(self, length: int) -> slice:
        """This rank's part of a sequence of ``length`` (all of it without Ulysses)."""
        if self.cp_group is None:
            return slice(0, length)
        cp, r = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        s = length // cp
        return slice(r * s, (r + 1) * s)

    def _loss_sum(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs, targets = self._inputs(mb)
        logits = self.model(**inputs, use_cache=False).logits
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        return loss

    def step(self, mbs: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Forward and backward of every micro-batch, clip, update; the global mean loss."""
        world = dist.get_world_size()
        cut = [self._shard(mb["labels"].shape[1]) for mb in mbs]
        pairs = list(zip(mbs, cut, strict=True))
        mine = sum(int((mb["labels"][:, c] != IGNORE).sum()) for mb, c in pairs)
        count = torch.tensor([float(mine)], device=self.device)
        dist.all_reduce(count)
        total = max(1.0, float(count.item()))
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss, tokens seen
        for mb, c in pairs:
            loss = self._loss_sum(mb)
            (loss * (world / total)).backward()
            sums[0] += loss.detach().double()
            sums[1] += mb["input_ids"][:, c].numel()
        grad_norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(sums)
        self.iteration += 1
        loss_value = float(sums[0]) / total
        return {"loss": loss_value, "grad_norm": grad_norm, "ok": True, "tokens": int(sums[1])}

    def _clip(self) -> float:
        """The global gradient norm (clipped to ``max_grad_norm`` when it is set)."""
        grads = [p for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        limit = self.t.max_grad_norm or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(grads, limit, foreach=False)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)
