"""``--stage grpo``: its flags, checks and task. GRPO is the shared policy task as it is: each
prompt's group of samples normalises its own rewards into advantages (no critic)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from anyspeed.stages.common.rl import flags
from anyspeed.training.task import StagePlan

if TYPE_CHECKING:
    from anyspeed.training.run import Run

add_arguments = flags.add_arguments
expand_config = flags.expand_config


def plan(args: argparse.Namespace) -> StagePlan:
    """GRPO's checks: a group of two or more, an estimator without a critic, then the shared
    RL ones."""
    from anyspeed.errors import UsageError
    from anyspeed.stages.common.rl.plan import rl_plan

    if args.n_samples_per_prompt < 2:
        raise UsageError(
            f"--n-samples-per-prompt {args.n_samples_per_prompt}: a group of one has no "
            "group-normalised advantage; sample 2 or more per prompt, or train a critic "
            "with --stage ppo"
        )
    if args.adv_estimator == "gae":
        raise UsageError("--adv-estimator gae needs a critic: use --stage ppo")
    return rl_plan(args)


def make_task(run: Run) -> Any:
    """The GRPO task of a checked run."""
    from anyspeed.checkpoint.record import hf_vocab
    from anyspeed.stages.common.rl.task import PolicyTask

    cfg = run.config
    return PolicyTask(cfg, run, hf_vocab(cfg.reference or run.load))
