"""``--stage distill``: its flags, checks and task (a frozen teacher beside the shared policy
task)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from anyspeed.stages.distill import flags
from anyspeed.training.task import StagePlan

if TYPE_CHECKING:
    from anyspeed.training.run import Run

add_arguments = flags.add_arguments
expand_config = flags.expand_config


def plan(args: argparse.Namespace) -> StagePlan:
    """The distillation flags, the shared RL checks (no rule reward unless named), then the
    teacher (converted last, once everything else holds)."""
    from anyspeed.stages.common.rl.plan import rl_plan
    from anyspeed.stages.distill import teacher

    update, estimator = flags.check_update(args)
    out = rl_plan(args, verifiers=())
    path, model = teacher.check(args)
    cfg = flags.DistillConfig(path, model, update, estimator, args.distill_coef, args.distill_topk)
    return dataclasses.replace(out, config=dataclasses.replace(out.config, extra=cfg))


def make_task(run: Run) -> Any:
    """The distillation task of a checked run."""
    from anyspeed.checkpoint.record import hf_vocab
    from anyspeed.stages.distill.task import DistillTask

    cfg = run.config
    return DistillTask(cfg, run, hf_vocab(cfg.reference or run.load))
