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
    """GRPO's checks: the shared RL ones."""
    from anyspeed.stages.common.rl.plan import rl_plan

    return rl_plan(args)


def make_task(run: Run) -> Any:
    """The GRPO task of a checked run."""
    from anyspeed.checkpoint.record import hf_vocab
    from anyspeed.stages.common.rl.task import PolicyTask

    cfg = run.config
    return PolicyTask(cfg, run, hf_vocab(cfg.reference or run.load))
