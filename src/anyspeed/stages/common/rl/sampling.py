"""How the policy task samples a rollout: each prompt's group drawn at once (or refilled under
``--filter-groups``), the sampling request, and the groups' rewards and advantages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from anyspeed.stages.common.rl import multiturn, process_reward
from anyspeed.stages.common.rl import objective as L
from anyspeed.stages.common.rl.batches import Rollout

if TYPE_CHECKING:
    from anyspeed.training.step import Trainer


class Sampling:
    """The policy task's sampling (a mixin of :class:`~.task.PolicyTask`: it reads its
    ``cfg``, tokenizer, EOS and pad ids, scorer, tool turns and rollout model)."""

    cfg: Any
    tok: Any
    eos: tuple[int, ...]
    pad: int
    vocab: int
    scorer: Any
    turns: Any
    tool_stats: Any
    roller: Any

    def sample(
        self, trainer: Trainer, data: Any, prompt_rows: np.ndarray, positions: range, args: Any
    ) -> Rollout:
        """Sample, score and (with ``--filter-groups``) refill: groups whose rewards are all
        equal carry no signal and are replaced by new prompts' groups, up to
        ``--max-num-gen-batches`` tries (then kept, with zero advantage)."""
        from megatron.core import parallel_state as ps

        c = self.cfg
        want, kept, dropped, tries = len(prompt_rows), [], [], 0
        rows, at = list(prompt_rows), list(positions)
        extra = np.random.default_rng([args.seed, positions.start, ps.get_data_parallel_rank()])
        while True:
            roll = self.sample_once(trainer, data, rows, [(tries, p) for p in at], args)
            if tries == 0 or len(kept) < want:  # a replica that is full samples in step
                for g in roll.groups():
                    (kept if not c.filter_groups or g.has_signal() else dropped).append(g)
            tries += 1
            if tries >= c.max_gen_batches or not multiturn.anyone(len(kept) < want):
                break
            rows = list(extra.choice(c.rows, size=max(1, want - len(kept))))
            at = [positions.start + i for i in range(len(rows))]
        return Rollout.join(kept[:want] + dropped[: max(0, want - len(kept))], want, len(kept))

    def sample_once(
        self, trainer: Trainer, data: Any, rows: list[int], keys: list[tuple[int, int]], args: Any
    ) -> Rollout:
        """Sample the groups of ``rows``; each sample draws from its own generator, seeded by
        (try, the prompt's place in the global order, the sample): the same tokens at every
        data-parallel size."""
        from anyspeed.inference.decode import Kept

        c = self.cfg
        prompts = [[int(t) for t in data.input_ids[i]] for i in rows]
        seeds = tuple(row_seed(args.seed, t, p, s) for t, p in keys for s in range(c.group))
        req = self.request(c.max_response, seeds, args)
        rep = [p for p in prompts for _ in range(c.group)]
        sampler = self.sampler(trainer)
        kept = Kept() if self.turns is not None and not req.lockstep else None
        tokens, lps = sampler(rep, req, kept=kept)
        masks, finals = None, tokens
        if self.turns is not None:  # tool calls answered, sampling continued from the cache
            traj = self.turns.run(sampler, rep, tokens, lps, req, kept)
            tokens, lps, masks = traj.tokens, traj.logps, traj.masks
            self.tool_stats.merge(traj.stats)
            finals = [t[at:] for t, at in zip(tokens, traj.last, strict=True)]  # the last turn
        return self.scored(trainer, data, rows, rep, (tokens, lps, masks, finals), args)

    def request(self, max_new: int, seeds: tuple[int, ...], args: Any) -> Any:
        """The sampling request of a rollout's rows (``seeds``: one per row)."""
        from anyspeed.inference.decode import Request
        from anyspeed.inference.sampling import SamplingParams

        c = self.cfg
        return Request(
            max_new,
            SamplingParams(False, c.temperature, c.top_k, c.top_p),
            eos_ids=self.eos,
            pad_id=self.pad,
            row_seeds=seeds,
            max_length=args.seq_length,
            vocab_size=self.vocab,
            lockstep=args.expert_model_parallel_size > 1,
        )

    def sampler(self, trainer: Trainer) -> Any:
        """``(prompts, request, kept=None) -> (tokens, log-probs)``: the rollout model's when
        the rollout runs at its own layout, else the trained model's."""
        return self.roller.sample if self.roller else trainer.sample

    def scored(
        self,
        trainer: Trainer,
        data: Any,
        rows: list[int],
        rep: list[list[int]],
        got: tuple,
        args: Any,
    ) -> Rollout:
        """The groups of prompt ``rows`` (``rep``: each prompt once per sample) with their
        sampled ``(tokens, log-probs, tool masks, last turns)``, rewarded, with advantages."""
        from anyspeed.inference.generate import decode

        c = self.cfg
        tokens, lps, masks, finals = got
        answers = [decode(self.tok, [int(t) for t in data.labels[i]]) for i in rows]
        labels = [a for a in answers for _ in range(c.group)]
        scores = self.scorer.scores(trainer, rep, tokens, finals, labels, args)
        rew = torch.tensor(scores, dtype=torch.float64)
        if c.adv_estimator in L.GROUP_ADVANTAGES:
            adv = L.group_advantages(rew, c.group, c.adv_estimator)
        else:  # a critic's (set per token by the stage's prepare)
            adv = torch.zeros_like(rew)
        step_r, step_a = process_reward.token_terms(self.scorer.steps, tokens, c, adv)
        return Rollout(rep, tokens, lps, rew, adv, c.group, len(rows), masks, step_r, step_a)


def row_seed(seed: int, turn: int, key: int, sample: int) -> int:
    """The generator seed of one sample's draw: (the run's seed, the try or round, the
    prompt's place in the global order, the sample)."""
    return (seed * 1_000_003 + turn * 7919 + key * 131 + sample) % 2**62
