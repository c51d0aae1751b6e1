"""From a command line to a checked, typed :class:`~anyspeed.training.run.Run`, before any
process group: parse once, complete the derived flags, freeze, the stage's checks, the
generic checks, and (for ``--load <HF dir>``) the cached conversion."""

from __future__ import annotations

import argparse
import os

from anyspeed.argv import get_flag, pop_values, set_flag
from anyspeed.convert import hf_cache as hf_load
from anyspeed.errors import UsageError
from anyspeed.stages import checks
from anyspeed.stages.arguments import parse_pretrain_args
from anyspeed.stages.common import raw_data
from anyspeed.stages.table import STAGES, build_stage_parser, get_stage
from anyspeed.training import hf_export
from anyspeed.training.run import Run, freeze
from anyspeed.training.task import Stage

# The stages whose every pipeline pass (training, frozen models' log-probs, rollouts decoding
# through the pipeline, a critic's values) runs through the DualPipeV schedule, each checked
# against one process; the VLM stage's towers are not.
DUALPIPEV_STAGES = ("pretrain", "sft", "dpo", "simpo", "orm", "prm", "grpo", "ppo", "distill")


def stage_of(argv: list[str], command: str) -> Stage:
    """The stage a command line names: ``pretrain`` for ``anyspeed pretrain``, ``--stage``'s
    row for ``anyspeed posttrain`` (UsageError listing the known stages otherwise)."""
    if command == "pretrain":
        return STAGES["pretrain"]()
    return get_stage(get_flag(argv, "--stage"), command)


def prepare(
    argv: list[str], where: str | None = None, command: str = "pretrain"
) -> tuple[Run, list[str]]:
    """Parse and check a command line (UsageError on any problem), before process groups.

    ``--load <HF dir>`` brings the architecture and tokenizer flags from the directory and
    converts its weights (once); the returned argv (for the launched ranks) names the
    converted checkpoint. A ``--load`` checkpoint's model record brings the architecture
    when the command line gives none. ``where`` is "launcher" when no launcher set
    WORLD_SIZE (the world is --nproc-per-node).
    """
    prog = f"anyspeed {command}"
    stage = stage_of(argv, command)
    if stage.argv is not None:  # e.g. a config file standing in for flags
        argv = stage.argv(argv)
    hf_dir = hf_load.hf_dir_of(argv)
    if hf_dir:
        argv = hf_load.expand(argv, hf_dir)
    else:
        argv = recorded_architecture(argv)
    args = parse_pretrain_args(argv, build_stage_parser(stage), prog=prog)
    world = (args.nproc_per_node or 1) if where == "launcher" else int(os.environ["WORLD_SIZE"])
    tokenizer = checks.complete(args)
    argv = _converted_data(args, argv, stage.name, command)
    freeze(args)
    if (
        getattr(args, "schedules_method", None) == "dualpipev"
        and stage.name not in DUALPIPEV_STAGES
    ):
        raise UsageError(  # before the stage's own checks, which know no V
            f"--schedules-method dualpipev: not supported in --stage {stage.name} yet (it runs "
            f"in anyspeed pretrain and posttrain --stage {'/'.join(DUALPIPEV_STAGES[1:])}); "
            "use Megatron's 1F1B here"
        )
    plan = stage.plan(args)
    export = hf_export.from_args(args, hf_dir)
    if export is not None and export.cfg_dir and not args.hf_cfg_dir:
        argv = set_flag(argv, "--hf-cfg-dir", export.cfg_dir)  # the ranks' --load is converted
    checked = checks.check(args, world, plan.data_prefixes, tokenizer)
    load = checked.load
    if hf_dir:
        load = hf_load.convert(args, hf_dir, prog)
        argv = set_flag(argv, "--load", load)
    if load and not hf_dir and not args.finetune and not getattr(plan.config, "lora", None):
        _check_resumed_stage(load, stage.name)
    run = Run(
        stage=stage.name,
        prog=prog,
        args=args,
        model=checked.model,
        layout=checked.layout,
        train=checked.train,
        world=world,
        tokenizer=tokenizer,
        load=load,
        hf_dir=hf_dir,
        config=plan.config,
        data=plan.data,
        records=dict(plan.records),
        export=export,
    )
    return run, argv


def _converted_data(
    args: argparse.Namespace, argv: list[str], stage: str, command: str
) -> list[str]:
    """A raw ``--data-path`` preprocessed here (once; reused after) and replaced by its
    ``.bin/.idx`` prefixes, in ``args`` and in the command line the ranks get."""
    before = list(args.data_path or [])
    raw_data.resolve(args, stage, command)
    after = list(args.data_path or [])
    if after == before:
        return argv
    return [*pop_values(argv, "--data-path")[1], "--data-path", *after]


def recorded_architecture(argv: list[str]) -> list[str]:
    """``argv`` with the architecture flags of its ``--load`` checkpoint's model record (or
    Megatron-LM's args) before it, when it names no architecture itself (no ``--model``, no
    ``--num-layers``): resuming needs only the checkpoint. Unreadable: ``argv`` as it is (the
    checks that follow name the problem)."""
    from anyspeed.argv import merge_flags
    from anyspeed.checkpoint.reads import read_common, tracked_dir
    from anyspeed.checkpoint.record import model_in_common

    load = get_flag(argv, "--load")
    if not load or get_flag(argv, "--model") or get_flag(argv, "--num-layers"):
        return argv
    try:
        path = tracked_dir(load) if os.path.isdir(load) else None
        model = model_in_common(read_common(path), load, as_hf=False) if path else None
    except Exception:  # noqa: BLE001 - a damaged checkpoint: the load checks report it
        return argv
    return merge_flags(model.megatron_args(), argv) if model is not None else argv


def _check_resumed_stage(load: str, stage: str) -> None:
    """Resuming (no --finetune) continues the run that wrote ``load``: a checkpoint of
    another stage (a pretraining checkpoint under ``--stage sft``, or back) is refused.
    Checkpoints written before stages were recorded, and iteration-0 ones, pass."""
    from anyspeed.checkpoint.reads import read_common, tracked_dir

    path = tracked_dir(load)
    common = read_common(path) if path else {}
    saved = common.get("anyspeed_stage")
    if saved and saved != stage and int(common.get("iteration", 0) or 0) > 0:
        raise UsageError(
            f"--load {load!r} holds a {saved} checkpoint and this run is {stage}: add "
            f"--finetune to start from its weights at iteration 0, or --load a {stage} "
            "checkpoint to resume it"
        )
