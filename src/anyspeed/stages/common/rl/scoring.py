"""A rollout's rewards, summed: the rule rewards (``--verifier-function``) of the decoded
answers, the reward model's score (``--reward-model``), the process reward model's step score
(``--process-reward-model``), each times its weight, and DAPO's overlong penalty. The same on
every rank of a replica; a raising reward stops every rank with the first rank's reason."""

from __future__ import annotations

from typing import Any

from anyspeed.stages.common.rl import process_reward, reward_model, rewards

# a process reward model's rollout statistics: its mean step score, and steps per sample
PRM_STATS = ("prm/step_score", "prm/steps")


class Scorer:
    """The policy task's rewards: its rule functions, and the reward models at their layout
    (a reward model run whole on every rank is built at its first use)."""

    def __init__(self, cfg: Any, tok: Any, eos: Any, pad: int) -> None:
        self.cfg, self.tok, self.eos, self.pad = cfg, tok, eos, pad
        self.reward_fn = rewards.resolve(cfg.verifiers, cfg.weights) if cfg.verifiers else None
        self.rm_whole: Any = None  # the reward model whole on every rank (--reward-*-size 1)
        self.steps: list[list[tuple[int, float]]] | None = None  # the last scores' steps
        self.totals = [0.0, 0.0, 0.0]  # the PRM's step scores, steps, samples since last stats

    @property
    def rewarded(self) -> bool:
        """Whether any reward is given (rule functions or a model)."""
        c = self.cfg
        return self.reward_fn is not None or bool(c.reward_model or c.process_reward)

    def scores(
        self,
        trainer: Any,
        prompts: list[list[int]],
        answers: list[list[int]],
        finals: list[list[int]],
        labels: list[str],
        args: Any,
    ) -> list[float]:
        """Each sample's reward: ``answers`` whole (tool turns included) for the models and the
        length penalty, ``finals`` (the last turn) for the rule functions."""
        from anyspeed.distributed.process import agree
        from anyspeed.inference.generate import decode

        c = self.cfg
        self.steps = None
        texts = [decode(self.tok, t[:-1] if t and t[-1] in self.eos else t) for t in finals]
        error, out = None, [0.0] * len(answers)
        try:
            if self.reward_fn is not None:
                prompt_texts = [decode(self.tok, p) for p in prompts]
                out = rewards.score(self.reward_fn, prompt_texts, texts, labels)
        except rewards.RewardError as exc:
            error = str(exc)
        error = agree(error)  # every rank stops, with the first rank's reason
        if error is not None:
            raise rewards.RewardError(error)
        if c.reward_model:
            rm = self.reward_model_scores(trainer, prompts, answers, args)
            out = [s + c.reward_model_weight * r for s, r in zip(out, rm, strict=True)]
        if c.process_reward:
            out = self._process_rewards(trainer, prompts, answers, args, out)
        if c.overlong_buffer > 0:
            pen = rewards.overlong_penalty(
                [len(t) for t in answers], c.max_response, c.overlong_buffer, c.overlong_factor
            )
            out = [s + p for s, p in zip(out, pen, strict=True)]
        return out

    def _process_rewards(
        self,
        trainer: Any,
        prompts: list[list[int]],
        answers: list[list[int]],
        args: Any,
        out: list[float],
    ) -> list[float]:
        """The PRM's steps, kept as (end token, score) per answer in :attr:`steps`: their
        combined score added to each reward, or (``dense``) left for per-token credit."""
        from anyspeed.stages.common.rl.step_scores import step_scores

        src = self.cfg.process_reward
        steps = step_scores(trainer, prompts, answers, args, self.pad, self.tok, self.eos, src)
        self.totals[0] += sum(v for s in steps for _, v in s)
        self.totals[1] += sum(len(s) for s in steps)
        self.totals[2] += len(steps)
        self.steps = steps
        if src.dense:
            return out
        combined = [process_reward.aggregate([v for _, v in s], src.aggregate) for s in steps]
        return [r + src.weight * p for r, p in zip(out, combined, strict=True)]

    def reward_model_scores(
        self, trainer: Any, prompts: list[list[int]], answers: list[list[int]], args: Any
    ) -> list[float]:
        """``--reward-model``'s score of each (prompt, sampled answer), on every rank of the
        replica: the answer closed as the template closes a turn, the model at its layout."""
        src = self.cfg.reward_model
        end = reward_model.turn_end(self.tok, args.prompt_type)
        scored = [reward_model.closed(t, self.eos, end) for t in answers]
        if src.whole and self.rm_whole is None:
            self.rm_whole = reward_model.WholeRewardModel(trainer, src)
        return reward_model.score_sequences(trainer, prompts, scored, args, self.pad, self.rm_whole)

    def prm_stats(self, device: Any) -> Any:
        """:data:`PRM_STATS` of the samples scored since the last call, over every replica
        (each replica's ranks hold the same scores: summed over data parallelism)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        t = torch.tensor(self.totals, dtype=torch.float64, device=device)
        dist.all_reduce(t, group=ps.get_data_parallel_group())
        self.totals = [0.0, 0.0, 0.0]
        return torch.stack([t[0] / t[1].clamp(min=1), t[1] / t[2].clamp(min=1)]).float()
