"""The PPO task: the RL stages' policy task with a critic. Each rollout is scored (the
sequence reward at its last answer token, the KL penalty per token when it goes in the
reward), the critic's values give GAE advantages and returns, the advantages are whitened over
every replica's answer tokens, the critic takes its optimizer steps on the clipped value loss,
and the policy its steps on the clipped (dual-clip) policy loss, as verl orders them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from anyspeed.distributed import pipeline
from anyspeed.distributed.process import print0
from anyspeed.stages.common.rl import objective as L
from anyspeed.stages.common.rl.batches import steps_of
from anyspeed.stages.common.rl.task import PolicyTask
from anyspeed.stages.ppo import loss as P
from anyspeed.stages.ppo.critic import Critic, SaveCritic

if TYPE_CHECKING:
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer

CRITIC = (
    "critic/vf_loss",
    "critic/vpred_mean",
    "critic/vf_clipfrac",
    "critic/grad_norm",
    "critic/vf_explained_var",
)


class PPOTask(PolicyTask):
    """Colocated PPO: the policy and its critic at the training layout in the same processes."""

    name, loss_key = "ppo", "ppo loss"

    def __init__(self, cfg: Any, run: Run, hf_vocab: int | None) -> None:
        super().__init__(cfg, run, hf_vocab)
        self.run = run
        self.critic: Any = None
        self.metrics = (*self.metrics, *CRITIC)

    def setup(self, trainer: Trainer) -> None:
        self.critic = Critic(self.run, self.cfg, self.cfg.extra.lr)
        self.critic.start(self.run, self.cfg.extra.load)

    def hooks(self, run: Run) -> list[Any]:
        return [SaveCritic(self), *super().hooks(run)]

    def warmup_rollouts(self) -> int:
        return self.cfg.extra.warmup

    def step_metrics(self, b: dict, n: torch.Tensor) -> dict[str, torch.Tensor]:
        s = b["critic_stats"][b.get("epoch", 0)]  # the critic's step of this pass
        return {k: torch.stack([s[i].double(), torch.ones_like(n)]) for i, k in enumerate(CRITIC)}

    def prepare(self, trainer: Trainer, micro: list[dict[str, Any]]) -> None:
        """Values, rewards per token, GAE, whitening; then the critic's steps (``ppo_epochs``
        passes over the rollout's mini-batches), its metrics on each mini-batch."""
        values = self.critic.values(micro)
        explained = last_stage_value(advantages(micro, values, self.cfg) if values else 0.0)
        steps = steps_of(micro)
        stats = torch.zeros(self.cfg.epochs, len(steps), len(CRITIC), dtype=torch.float64)
        stats[..., -1] = explained
        for e in range(self.cfg.epochs):
            for k, step in enumerate(steps):
                out = self.critic.step(step)
                stats[e, k, :-1] = torch.tensor([out[name] for name in CRITIC[:-1]])
        for k, step in enumerate(steps):
            for b in step:
                b["critic_stats"] = stats[:, k].to(b["tokens"].device)
        self.last = (float(stats[..., 0].mean()), explained)

    def warmed_up(self, done: int) -> None:
        print0(
            f" critic warm-up rollout {done}/{self.cfg.extra.warmup} | critic/vf_loss: "
            f"{self.last[0]:.6E} | critic/vf_explained_var: {self.last[1]:.4f}"
        )


def last_stage_value(x: float) -> float:
    """``x`` as the last pipeline stage has it, on every rank (the first prints the lines)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return x
    from anyspeed.device import torch_device

    t = torch.tensor([x], dtype=torch.float64, device=torch_device())
    src = pipeline.output_rank()
    dist.broadcast(t, src=src, group=ps.get_pipeline_model_parallel_group())
    return float(t.item())


def advantages(micro: list[dict[str, Any]], values: list[torch.Tensor], cfg: Any) -> float:
    """Set each micro-batch's ``values``, ``returns`` and whitened ``advantages`` (over every
    replica's answer tokens); returns the critic's explained variance of the returns."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    x = cfg.extra
    sums = torch.zeros(7, dtype=torch.float64)
    for b, v in zip(micro, values, strict=True):
        mask = b["loss_mask"].float()
        kl = None
        if cfg.kl_in_reward and cfg.beta:
            kl = L.kl_penalty(b["old_logp"], b["ref_logp"], cfg.kl_penalty)
        rewards = P.token_rewards(b["scores"], mask, kl, cfg.beta)
        if "token_rewards" in b:  # a process reward model's step rewards at the steps' ends
            rewards = rewards + b["token_rewards"] * mask
        adv, ret = P.gae(rewards, v, mask, x.gamma, x.lam)
        b["values"], b["returns"], b["advantages"] = v, ret, adv
        m, a, g, d = mask.double(), adv.double(), ret.double(), (ret - v).double()
        parts = [m, a * m, a * a * m, g * m, g * g * m, d * m, d * d * m]
        sums += torch.stack([x.sum() for x in parts]).cpu()
    sums = sums.to(micro[0]["tokens"].device)
    dist.all_reduce(sums, group=ps.get_data_parallel_group())
    n, sa, saa, sg, sgg, sd, sdd = sums.tolist()

    def var(s: float, ss: float) -> float:
        return (ss - s * s / n) / (n - 1)

    mean, std = sa / n, (var(sa, saa) + P.WHITEN_EPS) ** 0.5
    for b in micro:
        b["advantages"] = ((b["advantages"] - mean) / std).float()
    return 1.0 - var(sd, sdd) / (var(sg, sgg) + P.EXPLAINED_EPS)
