"""``anyspeed pretrain`` and ``anyspeed posttrain --stage S``: one entry over the stage table.

The command line is parsed and checked once, before any process group, into a typed run; then
either ``--nproc-per-node`` ranks are launched with torchrun (each prepares the same run) or
this process applies the adaptor and trains the run's stage. Every failure is one line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from anyspeed.errors import UsageError, report


def _help(argv: list[str], command: str) -> int:
    from anyspeed.stages.arguments import build_parser
    from anyspeed.stages.prepare import stage_of
    from anyspeed.stages.table import POSTTRAIN_STAGES, build_stage_parser

    try:
        build_stage_parser(stage_of(argv, command)).print_help()
    except UsageError:  # posttrain without a (known) --stage: the shared flags and the stages
        p = build_parser()
        p.prog = f"anyspeed {command}"
        from anyspeed.stages import flags as posttrain_flags

        posttrain_flags.add_arguments(p)
        p.print_help()
        print(f"\nstages: {', '.join(POSTTRAIN_STAGES)} (--stage S --help lists a stage's flags)")
    return 0


def _launch(run: Any, argv: list[str], command: str) -> int:
    """Start ``--nproc-per-node`` local ranks with torchrun (flags already checked); a signal
    to this process ends torchrun and every rank (exit 128 + signal, one line)."""
    from anyspeed.launch import supervise, torchrun_command, torchrun_env

    n = run.args.nproc_per_node
    return supervise(torchrun_command(n, "anyspeed", [command, *argv]), torchrun_env(n), run.prog)


def _sample(run: Any, history: dict[str, Any]) -> None:
    from anyspeed.distributed.process import print0
    from anyspeed.inference.generate import generate_text

    args = run.args
    text = generate_text(
        history["trainer"].model, args, args.generate_prompt, args.generate_tokens, run.tokenizer
    )
    if text is not None:
        print0(f"\nprompt: {args.generate_prompt!r}\nsample: {text!r}")


def main(
    argv: Sequence[str] | None = None, command: str = "pretrain", hooks: Sequence[Any] = ()
) -> int:
    """Entry point: parse, check (before any process group), launch or run, report;
    ``hooks`` (loop hooks) join the run's own in this process."""
    from anyspeed.checkpoint.errors import CheckpointError
    from anyspeed.distributed import stall
    from anyspeed.distributed.process import is_rank0, print0
    from anyspeed.stages.prepare import prepare
    from anyspeed.training.hooks import NonFiniteLoss
    from anyspeed.training.loop import DataExhausted
    from anyspeed.training.task import TaskStopped

    argv = list(sys.argv[1:] if argv is None else argv)
    prog = f"anyspeed {command}"
    if "-h" in argv or "--help" in argv:
        return _help(argv, command)
    under_launcher = "WORLD_SIZE" in os.environ
    try:
        run, argv = prepare(argv, None if under_launcher else "launcher", command)
    except UsageError as exc:
        return report(prog, exc) if is_rank0() else 2
    if not under_launcher and (run.args.nproc_per_node or 1) > 1:
        return _launch(run, argv, command)
    if not under_launcher:  # one process, no launcher: be rank 0 of a world of one
        from anyspeed.launch import single_process_env

        os.environ.update(single_process_env())
    from anyspeed import adaptor
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train

    adaptor.apply(run.args)
    try:
        history = train(run, task_for(run), extra_hooks=hooks)
    except (NonFiniteLoss, CheckpointError, DataExhausted, TaskStopped) as exc:  # rank 0 says why
        return report(prog, exc, code=1) if is_rank0() else 1
    except RuntimeError as exc:
        if stall.is_peer_lost(exc):
            stall.exit_on_lost_peer(prog)  # another rank's process ended; exits
        if not stall.is_timeout(exc):
            raise
        stall.exit_on_stall(prog, run.args.distributed_timeout_minutes)  # one line; exits
    if run.args.generate_prompt:
        _sample(run, history)
    losses = history["loss"]
    if losses:
        label = history["trainer"].task.loss_key
        print0(
            f"{prog}: done, iteration {history['iterations'][-1]}, {label} "
            f"{losses[0]:.4f} -> {losses[-1]:.4f}"
        )
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def pretrain(argv: Sequence[str] | None = None) -> int:
    """``anyspeed pretrain``."""
    return main(argv, "pretrain")


def posttrain(argv: Sequence[str] | None = None) -> int:
    """``anyspeed posttrain --stage S``."""
    return main(argv, "posttrain")
