"""The training step: a model pipeline, an optimizer and Megatron's pipeline schedules.

:class:`Trainer` owns the model chunks (built by :mod:`anyspeed.training.model_pipeline`) and
the optimizer, and runs one optimizer step or one evaluation over the micro-batches it is
given; the :class:`~anyspeed.training.task.Task` supplies the forward step and loss. Data,
logging, checkpoints and stopping belong to the loop (:mod:`anyspeed.training.loop`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from anyspeed.distributed import pipeline
from anyspeed.distributed.dualpipev.plan import check_microbatches
from anyspeed.distributed.groups import init_distributed
from anyspeed.distributed.process import world_size
from anyspeed.layout import Layout
from anyspeed.models import dsa
from anyspeed.models.config import ModelConfig
from anyspeed.training.config import TrainConfig
from anyspeed.training.model_pipeline import (
    Transform,
    build_model,
    build_optimizer,
    eval_mode,
    sequence_parallel_off,
    unwrap,
)
from anyspeed.training.moe_metrics import MoEMetrics
from anyspeed.training.task import Task


class Trainer:
    """Model, optimizer and layout of this rank; ``step(micro_batches)`` is one optimizer step."""

    def __init__(
        self,
        model: ModelConfig,
        layout: Layout,
        cfg: TrainConfig,
        task: Task,
        transforms: Sequence[Transform] = (),
        start_groups: bool = True,
    ) -> None:
        world = world_size()
        layout.validate_for(world, model, cfg.seq_length)
        self.dp = layout.dp(world)
        cfg.check(self.dp)
        if layout.dualpipev:
            check_microbatches(layout.pp, cfg.global_batch_size // (cfg.micro_batch_size * self.dp))
        self.model_config, self.layout, self.cfg = model, layout, cfg
        self.task = task
        if start_groups:  # False: a second model of the run (a critic) in the groups in place
            init_distributed(layout, cfg.seed)
        self.model = build_model(
            model, layout, cfg, [*self.task.transforms(), *transforms], builder=self.task.build
        )
        self.optimizer = build_optimizer(self.model, cfg, layout)
        self.model[0].config.grad_scale_func = self.optimizer.scale_loss
        self.moe = None
        if model.is_moe:
            layers = model.num_layers + (model.mtp_num_layers or 0)  # MTP layers route too
            self.moe = MoEMetrics(self.model, layout, layers, model.num_experts or 0)
        self.frozen: dict[str, Any] = {}  # the task's frozen models (engine-built)
        self.iteration = 0
        # Called with the trainer between the backward pass (gradients reduced) and the
        # optimizer step: ``anyspeed verify`` reads the gradients there.
        self.before_update: list[Any] = []

    def _run_schedule(
        self,
        mbs: list[dict[str, torch.Tensor]],
        forward_only: bool,
        task: Task | None = None,
        model: list[Any] | None = None,
    ) -> tuple[float, dict[str, float]]:
        """Run the pipeline schedule over ``mbs``; the loss and every named metric, each
        averaged over DP replicas (a ``[sum, count]`` metric: one global ratio)."""
        from megatron.core import parallel_state as ps

        from anyspeed.device import torch_device
        from anyspeed.training.packed_rows import schedule_shape

        task, model = task or self.task, model or self.model
        data = [iter(mbs) for _ in model] if len(model) > 1 else iter(mbs)
        seq, mbs_size = schedule_shape(task, self.cfg, mbs)
        losses = pipeline.forward_backward_func()(
            forward_step_func=task.forward_step,
            data_iterator=data,
            model=model if len(model) > 1 else model[0],
            num_microbatches=len(mbs),
            seq_length=seq,
            micro_batch_size=mbs_size,
            forward_only=forward_only,
        )
        keys = [task.loss_key, *task.metrics]
        # Every rank takes part in the reduction; the output stage's TP rank 0 contributes.
        last = pipeline.is_output_stage() and ps.get_tensor_model_parallel_rank() == 0
        total = torch.zeros(len(keys), 3, dtype=torch.float64, device=torch_device())
        if last and losses:
            for i, key in enumerate(keys):
                vals = torch.stack([x[key].detach().double().reshape(-1).cpu() for x in losses])
                if vals.shape[1] == 2:  # (sum, count) per micro-batch
                    total[i, :2] += vals.sum(0).to(total.device)
                else:
                    total[i, 2] = vals.mean()
        torch.distributed.all_reduce(total)
        out = {}
        for i, key in enumerate(keys):
            if total[i, 1] > 0:  # a global ratio over every rank's tokens or pairs
                out[key] = float(total[i, 0] / total[i, 1])
            else:  # CP ranks' shares sum to the replica's mean
                out[key] = float(total[i, 2]) / self.dp
        return out.pop(task.loss_key), out

    def step(self, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """One optimizer step on this rank's ``microbatches``; the loss is the DP mean."""
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.moe is not None:
            self.moe.reset()
        indexer = self.model_config.dsa_indexer_loss_coeff > 0 and (
            self.model_config.experimental_attention_variant == "dsa"
        )
        if indexer:  # the indexer loss's gradient at the main loss's scale
            dsa.set_loss_scale(self.model[0].config, len(microbatches))
        loss, metrics = self._run_schedule(microbatches, forward_only=False)
        if indexer:
            metrics["indexer kl"] = dsa.step_kl()
        if self.model_config.mtp_num_layers:
            from anyspeed.training.mtp_metrics import mtp_losses

            depths = self.model_config.mtp_num_layers
            metrics.update(mtp_losses(depths, len(microbatches), self.dp))
        for fn in self.before_update:
            fn(self)
        ok, grad_norm, _ = self.optimizer.step()
        self.iteration += 1
        out = {
            "loss": loss,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "ok": bool(ok),
            "metrics": metrics,
            "tokens": self.tokens(microbatches),
        }
        if self.moe is not None:
            out["moe"] = self.moe.collect(len(microbatches))
        return out

    def tokens(self, microbatches: list[dict[str, torch.Tensor]]) -> int | None:
        """Token positions a step over ``microbatches`` processes on all replicas (this rank's
        share of each sequence under context parallelism); None when a micro-batch has no
        ``tokens`` tensor."""
        if not microbatches or any("tokens" not in b for b in microbatches):
            return None
        from anyspeed.training.packed_rows import token_count

        local = sum(token_count(b) for b in microbatches)
        return local * self.dp * self.layout.cp

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict[str, torch.Tensor]]) -> float:
        """Mean loss of ``microbatches`` without updating anything."""
        return self.evaluate_metrics(microbatches)[0]

    @torch.no_grad()
    def evaluate_metrics(
        self,
        microbatches: list[dict[str, torch.Tensor]],
    ) -> tuple[float, dict[str, float]]:
        """(mean loss, named metrics) of ``microbatches`` without updating anything."""
        with eval_mode(self.model):
            return self._run_schedule(microbatches, forward_only=True)

    def logprobs(
        self,
        microbatches: list[dict[str, torch.Tensor]],
        model: str | None = None,
        vocab_size: int | None = None,
        temperature: float = 1.0,
        exact: bool = False,
    ) -> list[torch.Tensor] | None:
        """Per-token log-probabilities of each micro-batch's labels ([b, s] each, this rank's
        CP share) by the training model or the frozen model ``model``, forward only: a
        reference or old-policy pass (``temperature``: of a sampling policy). On the last
        pipeline stage; None on the others. ``exact``: with autograd on (no backward), whose
        kernels give the training forward's values bit for bit (an old-policy pass whose
        ratio must be exactly 1 before an update)."""
        from anyspeed.training.logprob_pass import logprob_pass

        chunks, ctx = (
            (self.model, contextlib.nullcontext())
            if model is None
            else (self.frozen[model].chunks, self.frozen[model].context())
        )
        grad = torch.enable_grad() if exact else torch.no_grad()
        with grad, eval_mode(chunks), ctx:
            return logprob_pass(self, chunks, microbatches, vocab_size, temperature)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], request: Any) -> list[list[int]]:
        """New tokens for each prompt from the training model at the training layout (the
        KV-cache decoder of :mod:`anyspeed.inference`), the model in eval mode and back;
        the same tokens on every rank."""
        from anyspeed.features.inference.weights import packed_during
        from anyspeed.inference.decode import generate

        chunks = [unwrap(m) for m in self.model]
        with eval_mode(self.model), sequence_parallel_off(self.model), packed_during(chunks):
            return generate(chunks, prompts, request)

    @torch.no_grad()
    def sample(
        self, prompts: list[list[int]], request: Any, kept: Any = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """:meth:`generate` with each new token's log-probability under the sampling
        temperature (a rollout's own log-probs), the same on every rank; ``kept``
        (:class:`anyspeed.inference.decode.Kept`) keeps the KV cache for a next turn."""
        from anyspeed.features.inference.weights import packed_during
        from anyspeed.inference.decode import sample

        chunks = [unwrap(m) for m in self.model]
        with eval_mode(self.model), sequence_parallel_off(self.model), packed_during(chunks):
            return sample(chunks, prompts, request, logprobs=True, kept=kept)
