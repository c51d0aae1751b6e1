"""The training step: a model pipeline, an optimizer and Megatron's pipeline schedules.

:class:`Trainer` owns the model chunks (built by :mod:`anyspeed.training.model_pipeline`) and
the optimizer, and runs one optimizer step or one evaluation over the micro-batches it is
given; the :class:`~anyspeed.training.tasks.Task` supplies the forward step and loss. Data,
logging, checkpoints and stopping belong to the loop (:mod:`anyspeed.training.loop`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from anyspeed.layout import Layout
from anyspeed.models.config import ModelConfig
from anyspeed.training.config import TrainConfig
from anyspeed.training.distributed import init_distributed, world_size
from anyspeed.training.model_pipeline import Transform, build_model, build_optimizer
from anyspeed.training.moe_metrics import MoEMetrics
from anyspeed.training.tasks import PretrainTask, Task


class Trainer:
    """Model, optimizer and layout of this rank; ``step(micro_batches)`` is one optimizer step."""

    def __init__(
        self,
        model: ModelConfig,
        layout: Layout,
        cfg: TrainConfig,
        task: Task | None = None,
        transforms: Sequence[Transform] = (),
    ) -> None:
        world = world_size()
        layout.validate_for(world, model, cfg.seq_length)
        self.dp = layout.dp(world)
        cfg.check(self.dp)
        self.model_config, self.layout, self.cfg = model, layout, cfg
        self.task = task or PretrainTask()
        init_distributed(layout, cfg.seed)
        self.model = build_model(model, layout, cfg, [*self.task.transforms(), *transforms])
        self.optimizer = build_optimizer(self.model, cfg, layout)
        self.model[0].config.grad_scale_func = self.optimizer.scale_loss
        self.moe = None
        if model.is_moe:
            self.moe = MoEMetrics(self.model, layout, model.num_layers, model.num_experts or 0)
        self.iteration = 0

    def _run_schedule(self, mbs: list[dict[str, torch.Tensor]], forward_only: bool) -> float:
        """Run the pipeline schedule over ``mbs``; return the loss averaged over DP replicas."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from anyspeed.device import torch_device

        data = [iter(mbs) for _ in self.model] if len(self.model) > 1 else iter(mbs)
        seq, mbs_size = self.task.schedule_shape(self.cfg.seq_length, self.cfg.micro_batch_size)
        losses = get_forward_backward_func()(
            forward_step_func=self.task.forward_step,
            data_iterator=data,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(mbs),
            seq_length=seq,
            micro_batch_size=mbs_size,
            forward_only=forward_only,
        )
        # The loss on every rank: the last stage averages its micro-batch losses.
        last = (
            ps.is_pipeline_last_stage(ignore_virtual=True)
            and ps.get_tensor_model_parallel_rank() == 0
        )
        total = torch.zeros(2, dtype=torch.float64, device=torch_device())
        if last and losses:
            vals = torch.stack([x[self.task.loss_key].detach().double().reshape(-1).cpu()
                                for x in losses])  # fmt: skip
            if vals.shape[1] == 2:  # (token-loss sum, token count) per micro-batch
                total += vals.sum(0).to(total.device)
            else:
                total[0] = vals.mean()
        torch.distributed.all_reduce(total)
        if total[1] > 0:  # a global token mean over every rank's tokens
            return float(total[0] / total[1])
        return float(total[0]) / self.dp  # CP ranks' shares sum to the replica's mean

    def step(self, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """One optimizer step on this rank's ``microbatches``; the loss is the DP mean."""
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.moe is not None:
            self.moe.reset()
        loss = self._run_schedule(microbatches, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.iteration += 1
        out = {
            "loss": loss,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "ok": bool(ok),
        }
        if self.moe is not None:
            out["moe"] = self.moe.collect(len(microbatches))
        return out

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict[str, torch.Tensor]]) -> float:
        """Mean loss of ``microbatches`` without updating anything."""
        for m in self.model:
            m.eval()
        try:
            return self._run_schedule(microbatches, forward_only=True)
        finally:
            for m in self.model:
                m.train()
