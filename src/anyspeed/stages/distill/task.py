"""The distillation task: the RL stages' policy task whose signal is a frozen teacher's.

Each rollout samples from the student, then the teacher scores every sampled token (its
log-probability, at the sampling temperature). With ``policy-gradient`` a token's reward is
minus the estimate of KL(student || teacher) at it, from the old (rollout) log-probability, and
its advantage is that reward alone (no discount: Thinking Machines' on-policy distillation),
plus the group advantage of any rule reward; the clipped policy loss does the rest. With
``supervised`` the estimate at the current log-probability is itself a per-token loss term
(verl's supervised distillation); with ``topk``, KL(teacher || student) over the teacher's top
tokens at each answer position is (verl's top-k forward KL). ``distill/reverse_kl`` is the k1
estimate of KL(student || teacher) over each step's answer tokens, at the rollout;
``timing/teacher`` the seconds of the teacher's pass over the step's rollout (this replica's).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.stages.common.rl import objective as L
from anyspeed.stages.common.rl.task import PolicyTask
from anyspeed.stages.distill import teacher
from anyspeed.stages.distill.loss import topk_forward_kl
from anyspeed.training.task import FrozenModel

if TYPE_CHECKING:
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer

METRICS = ("distill/reverse_kl", "timing/teacher")
REWARD_STATS = (
    "grpo/rewards/mean",
    "grpo/rewards/min",
    "grpo/rewards/max",
    "grpo/zero_adv_groups",
    "grpo/kept_groups",
)


class DistillTask(PolicyTask):
    """Colocated on-policy distillation: the student samples, the teacher scores, the student
    takes clipped policy-gradient (or supervised KL) steps."""

    name, loss_key = "distill", "distill loss"

    def __init__(self, cfg: Any, run: Run, hf_vocab: int | None) -> None:
        super().__init__(cfg, run, hf_vocab)
        self.dc = cfg.extra
        rewarded = self.scorer.rewarded
        # without rewards their statistics are zeros: left off the log line and the files
        shown = [m for m in self.metrics if rewarded or m not in REWARD_STATS]
        self.metrics = (*shown, *METRICS)
        self.teacher_s = 0.0  # the last rollout's teacher pass, seconds

    def frozen_models(self) -> dict[str, FrozenModel]:
        return {
            **super().frozen_models(),
            **teacher.frozen(self.dc.teacher, self.dc.model, self.cfg.packing),
        }

    def prepare(self, trainer: Trainer, micro: list[dict[str, Any]]) -> None:
        """The teacher's log-probabilities (and top-k); with policy-gradient, each token's
        advantage."""
        t0 = time.perf_counter()
        c, dc = self.cfg, self.dc
        if dc.update == "topk":
            top = teacher.topk(trainer, micro, self.vocab, c.temperature, dc.topk)
            if top is not None:
                for b, (lp, ids, top_lp) in zip(micro, top, strict=True):
                    b["teacher_logp"], b["teacher_ids"], b["teacher_top_logp"] = lp, ids, top_lp
            self.teacher_s = time.perf_counter() - t0
            return
        lps = teacher.logprobs(trainer, micro, self.vocab, c.temperature)
        self.teacher_s = time.perf_counter() - t0
        if lps is None:  # not the last pipeline stage: no loss is computed here
            return
        for b, lp in zip(micro, lps, strict=True):
            b["teacher_logp"] = lp
            if dc.update == "policy-gradient":
                kl = L.kl_penalty(b["old_logp"], lp, dc.estimator)
                b["advantages"] = b["advantages"] - dc.coef * kl

    def logprob_ids(self, b: dict) -> torch.Tensor | None:
        """With topk: the teacher's top tokens (on the last pipeline stage, where they are)."""
        return b.get("teacher_ids") if self.dc.update == "topk" else None

    def token_terms(self, logp: torch.Tensor, b: dict) -> torch.Tensor | None:
        if self.dc.update == "topk":
            return self.dc.coef * topk_forward_kl(b["logp_at"], b["teacher_top_logp"])
        if self.dc.update != "supervised":
            return None
        return self.dc.coef * L.kl_penalty(logp, b["teacher_logp"], self.dc.estimator)

    def step_metrics(self, b: dict, n: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = b["loss_mask"].double()
        k1 = (b["old_logp"].double() - b["teacher_logp"].double()) * mask
        took = torch.tensor(self.teacher_s, dtype=torch.float64, device=n.device)
        return {
            "distill/reverse_kl": torch.stack([k1.sum(), n]),
            "timing/teacher": torch.stack([took, torch.ones_like(n)]),
        }
