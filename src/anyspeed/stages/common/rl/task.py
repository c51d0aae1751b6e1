"""The policy task of the RL stages (GRPO as it is; PPO adds a critic): each rollout samples
``n_samples_per_prompt`` answers per prompt from the policy at the training layout (the KV-cache
decoder, the model's own code), scores them with the rule rewards, normalises the rewards per
group, recomputes the old (and reference) log-probs forward-only, and then yields
``ppo_epochs`` passes of optimizer steps over it.

Each data-parallel replica rolls out its own share of the prompts; every rank of a replica
samples the same tokens. The rollout's own log-probs are kept: their difference from the
recomputed ones (``rollout/logp_mismatch``) is the rollout/training mismatch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from anyspeed.models.logprobs import token_logprobs
from anyspeed.stages.common.losses import per_token_loss
from anyspeed.stages.common.rl import correction, multiturn, partial, process_reward, reward_model
from anyspeed.stages.common.rl import objective as L
from anyspeed.stages.common.rl.batches import (
    STATS,
    TOOL_STATS,
    Rollout,
    global_stats,
    micro_batches,
    mismatch,
    steps_of,
)
from anyspeed.stages.common.rl.sampling import Sampling
from anyspeed.training.packed_rows import model_inputs, to_packed, to_rows
from anyspeed.training.task import FrozenModel, LossFunc, Task

if TYPE_CHECKING:
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer

ACTOR = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy")


@dataclass
class _Clock:
    rollout: float = 0.0
    old: float = 0.0
    ref: float = 0.0
    reshard: float = 0.0


class PolicyTask(Sampling, Task):
    """Colocated policy optimisation: rollouts between optimizer steps, then clipped
    policy-gradient updates (GRPO's group advantages unless a stage computes its own)."""

    name, loss_key = "grpo", "grpo loss"
    metrics = ACTOR + STATS

    def __init__(self, cfg: Any, run: Run, hf_vocab: int | None) -> None:
        from anyspeed.data.tokenizer import end_ids
        from anyspeed.stages.common.rl.scoring import PRM_STATS, Scorer

        self.cfg, self.tok = cfg, run.tokenizer
        self.vocab = hf_vocab or self.tok.vocab_size  # rollout and training: the same rows
        self.eos = end_ids(self.tok)
        self.pad = self.tok.pad_id if self.tok.pad_id is not None else 0
        self.scorer = Scorer(cfg, self.tok, self.eos, self.pad)  # the rollout's rewards
        self.reference = cfg.reference or run.load
        self.roller: Any = None  # the rollout model at TP 1 x DP world (--infer-* 1 1)
        self.stat_names = STATS + (TOOL_STATS if cfg.tools else ())
        self.stat_names += PRM_STATS if cfg.process_reward else ()
        self.turns = multiturn.tool_turns(cfg, run, self.eos)  # multi-turn rollouts (--tools)
        self.tool_stats: Any = None  # this rollout's (multiturn.ToolStats)
        self.partial: Any = None  # the answers in flight (--partial-rollout-max-split)
        if cfg.partial is not None:
            from anyspeed.stages.common.rl.partial_draw import PartialRollouts

            self.partial = PartialRollouts(cfg, self.eos)
            self.stat_names += partial.STATS
        self.metrics = ACTOR + self.stat_names + (correction.METRICS if cfg.correction else ())

    # ---------------------------------------------------------------- the task interface
    def transforms(self) -> list[Any]:
        from anyspeed.stages.common.reference import packed_transforms

        lora = [self.cfg.lora.transform()] if self.cfg.lora else []
        return [per_token_loss, *packed_transforms(self.cfg.packing), *lora]

    def frozen_models(self) -> dict[str, FrozenModel]:
        from anyspeed.stages.common.reference import reference_model

        out = {}
        if self.cfg.beta:  # no KL term: no reference is built
            out = reference_model(
                self.cfg.lora, self.reference, self.cfg.reference_iteration, self.cfg.packing
            )
        if self.cfg.reward_model:
            out.update(reward_model.frozen(self.cfg.reward_model))
        if self.cfg.process_reward:
            out.update(process_reward.frozen(self.cfg.process_reward))
        return out

    def records(self) -> dict[str, Any]:
        from anyspeed.stages.common.reference import reference_record

        if self.cfg.beta == 0:
            return {}
        return reference_record(self.cfg.lora, self.reference, self.cfg.reference_iteration)

    def hooks(self, run: Run) -> list[Any]:
        return [self.partial.saver()] if self.partial is not None else []

    def load(self, run: Run, trainer: Trainer, scheduler: Any, state: LoopState) -> bool:
        from anyspeed.stages.common.lora_start import lora_start

        return lora_start(self.cfg.lora, run, trainer, scheduler, state)

    def datasets(self, run: Run) -> list[Any]:
        return [(run.data, self.cfg.rows), None, None]

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        b = next(data_iterator)
        tokens, pos, labels, packed = model_inputs(b)
        at = self.logprob_ids(b)
        out = token_logprobs(
            model,
            tokens,
            pos,
            labels,
            packed_seq_params=packed,
            vocab_size=self.vocab,
            temperature=self.cfg.temperature,
            entropy=True,
            entropy_grad=bool(self.cfg.entropy_coeff),
            at=None if at is None else to_packed(at, b),
        )

        def loss_func(output: torch.Tensor):
            output = to_rows(output, b)  # a packed sequence's outputs back in their rows
            if output.shape[0] > 2:  # the log-probs at logprob_ids, [b, s, k]
                b["logp_at"] = output[2:].permute(1, 2, 0)
            return self.token_loss(output[0], output[1], b)

        return out, loss_func

    def logprob_ids(self, b: dict) -> torch.Tensor | None:
        """Token ids [b, s, k] whose log-probs :meth:`token_terms` reads (``b["logp_at"]``)."""
        return None

    def token_loss(self, logp: torch.Tensor, entropy: torch.Tensor, b: dict) -> tuple:
        """(loss sum, count, metrics) of one micro-batch under the aggregation mode."""
        from anyspeed.stages.common.losses import cp_sum

        c = self.cfg
        mask = b["loss_mask"].float()
        log_w = L.log_importance(logp, b["old_logp"], mask, c.is_level, cp_sum)
        t = L.policy_terms(log_w, b["advantages"], c.clip_low, c.clip_high, c.dual_clip)
        per_token = t["pg"] * b["is_weight"] if "is_weight" in b else t["pg"]
        kl = torch.zeros_like(logp)
        if c.beta and not c.kl_in_reward:
            kl = L.kl_penalty(logp, b["ref_logp"], c.kl_penalty)
            per_token = per_token + c.beta * kl
        if c.entropy_coeff:
            per_token = per_token - c.entropy_coeff * entropy
        own = self.token_terms(logp, b)
        if own is not None:
            per_token = per_token + own
        seq = cp_sum(torch.stack([(per_token * mask).sum(-1), mask.sum(-1)]))
        total, count = L.aggregate(seq[0], seq[1], c.agg, c.max_response)
        n = mask.sum().double()

        def mean(x: torch.Tensor) -> torch.Tensor:
            return torch.stack([(x.detach().double() * mask).sum(), n])

        metrics = {
            self.loss_key: torch.stack([total.detach().double(), count.double()]),
            "actor/pg_loss": mean(t["pg"]),
            "actor/pg_clipfrac": mean(t["clipped"]),
            "actor/ppo_kl": mean(b["old_logp"] - logp),
            "actor/kl_loss": mean(kl),
            "actor/entropy": mean(entropy),
        }
        if c.correction is not None:
            metrics.update(correction.diagnostics(b, c.correction))
        metrics.update(self.step_metrics(b, n))
        for i, name in enumerate(self.stat_names):
            metrics[name] = torch.stack([b["stats"][i].double(), torch.ones_like(n)])
        return total, count.round().to(torch.int), metrics

    def token_terms(self, logp: torch.Tensor, b: dict) -> torch.Tensor | None:
        """A stage's own per-token loss terms [b, s] (distillation's KL to its teacher), added
        before the aggregation; None: none."""
        return None

    def step_metrics(self, b: dict, n: torch.Tensor) -> dict[str, torch.Tensor]:
        """A stage's own metrics of a micro-batch (``[sum, count]`` each; PPO: its critic's)."""
        return {}

    def warmup_rollouts(self) -> int:
        """Rollouts before the policy's first step that train only a stage's critic."""
        return 0

    def warmed_up(self, done: int) -> None:
        """After the ``done``-th warm-up rollout (PPO: one line of its critic's loss)."""

    def prepare(self, trainer: Trainer, micro: list[dict[str, Any]]) -> None:
        """A stage's work on a rollout's micro-batches once the old (and reference) log-probs
        are in (PPO: values, advantages and the critic's update); GRPO's advantages are set."""

    # ------------------------------------------------------------------------- rollouts
    def batches(
        self,
        dataset: Any,
        run: Run,
        consumed: int,
        device: torch.device,
        trainer: Trainer | None = None,
    ) -> Iterator[list[dict[str, Any]]]:
        """Per optimizer step, this rank's micro-batches; a new rollout when the last one's
        ``ppo_epochs`` passes are done (resuming mid-rollout rolls out again)."""
        from megatron.core import parallel_state as ps

        from anyspeed.stages.common.instruction_data import sample_order

        data, rows = dataset
        c, args = self.cfg, run.args
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        per_rank, gbs = c.rollout_batch // dp, args.global_batch_size
        warm = self.warmup_rollouts()  # the first prompts train only a critic, once
        r = consumed // (gbs * c.steps_per_rollout) + warm
        skip = (consumed // gbs) % c.steps_per_rollout
        n = (args.train_iters // c.steps_per_rollout + 2 + warm) * c.rollout_batch
        shuffle = not getattr(args, "no_shuffle", False)
        order = rows[sample_order((0, len(rows)), n, args.seed, shuffle)]
        if self.partial is not None:
            self.partial.resume(self.cfg.lora, run)

        def rollout(at: int) -> list[dict[str, Any]]:
            if self.partial is not None:  # groups from the buffer of answers in flight
                draw = self.partial.drawer(self, trainer, data, order, at, args)
                return self.rolled(trainer, draw, args, device)
            start = at * c.rollout_batch + rank * per_rank
            where = range(start, start + per_rank)
            return self.rollout(trainer, data, order[where.start : where.stop], where, args, device)

        for w in range(warm if consumed == 0 else 0):
            rollout(w)
            self.warmed_up(w + 1)
        while True:
            steps = steps_of(rollout(r))
            for epoch in range(c.epochs):
                for step in steps:
                    if skip:
                        skip -= 1
                        continue
                    for b in step:  # the pass a step belongs to (its metrics may differ)
                        b["epoch"] = epoch
                    yield step
            r += 1

    def rollout(
        self,
        trainer: Trainer,
        data: Any,
        prompt_rows: np.ndarray,
        positions: range,
        args: Any,
        device: torch.device,
    ) -> list[dict[str, Any]]:
        """One rollout of this replica's prompts: sampled, rewarded, with old/reference
        log-probs and the rollout's global statistics on every micro-batch."""

        def draw() -> tuple[Rollout, list[float]]:
            return self.sample(trainer, data, prompt_rows, positions, args), []

        return self.rolled(trainer, draw, args, device)

    def rolled(
        self,
        trainer: Trainer,
        draw: Callable[[], tuple[Rollout, list[float]]],
        args: Any,
        device: torch.device,
    ) -> list[dict[str, Any]]:
        """The micro-batches of the rollout ``draw`` samples (with its own statistics after
        the rollout's): old/reference log-probs, the stage's preparation, the statistics."""
        clock = _Clock()
        if self.cfg.reshard:
            from anyspeed.stages.common.rl.rollout_model import RolloutModel

            self.roller = self.roller or RolloutModel(trainer)
            clock.reshard = self.roller.sync(trainer)
        t0 = time.perf_counter()
        if self.turns is not None:
            from anyspeed.stages.common.rl.multiturn import ToolStats

            self.tool_stats = ToolStats()
        roll, own = draw()
        clock.rollout = time.perf_counter() - t0
        micro = micro_batches(roll, args, self.pad, device, self.cfg.packing)
        t0 = time.perf_counter()
        old = trainer.logprobs(
            micro, vocab_size=self.vocab, temperature=self.cfg.temperature, exact=True
        )
        clock.old = time.perf_counter() - t0
        if old is not None:
            for b, lp in zip(micro, old, strict=True):
                b["old_logp"] = lp
                if self.cfg.correction is not None:
                    correction.apply(b, self.cfg.correction)
        if self.cfg.beta:
            t0 = time.perf_counter()
            ref = trainer.logprobs(
                micro, model="reference", vocab_size=self.vocab, temperature=self.cfg.temperature
            )
            clock.ref = time.perf_counter() - t0
            if ref is not None:
                for b, lp in zip(micro, ref, strict=True):
                    b["ref_logp"] = lp
        self.prepare(trainer, micro)
        stats = global_stats(roll, mismatch(micro), clock, device, self.tool_stats)
        if self.cfg.process_reward:
            stats = torch.cat([stats, self.scorer.prm_stats(device).to(stats.dtype)])
        if own:
            stats = torch.cat([stats, torch.tensor(own, dtype=stats.dtype, device=device)])
        for b in micro:
            b["stats"] = stats
        return micro
