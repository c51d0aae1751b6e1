"""``--stage ppo``: its flags, checks and task (a critic beside the shared policy task)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from anyspeed.stages.ppo import flags
from anyspeed.training.task import StagePlan

if TYPE_CHECKING:
    from anyspeed.training.run import Run

add_arguments = flags.add_arguments
expand_config = flags.expand_config


def plan(args: argparse.Namespace) -> StagePlan:
    """The critic's checks, then the shared RL ones (the critic's config kept in the run's)."""
    from anyspeed.stages.common.rl.plan import rl_plan

    critic = flags.critic_config(args)
    return rl_plan(
        args,
        critic,
        dual_clip=args.clip_ratio_c or None,
        kl_in_reward=args.use_kl_in_reward,
    )


def make_task(run: Run) -> Any:
    """The PPO task of a checked run."""
    from anyspeed.checkpoint.record import hf_vocab
    from anyspeed.stages.ppo.task import PPOTask

    cfg = run.config
    return PPOTask(cfg, run, hf_vocab(cfg.reference or run.load))
