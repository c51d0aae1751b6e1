"""The life of an inference command: parse once into a frozen :class:`~.session.InferenceRun`
and check it (before any process group), launch ``TP x PP`` ranks with torchrun when asked, load
the model (GPT or LLaVA, as its record says), run the body, report errors in one line.
``anyspeed generate`` and ``anyspeed evaluate`` differ only in their flags, checks and body."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from anyspeed.commands import session, training_flags
from anyspeed.commands.session import InferenceRun
from anyspeed.distributed.process import is_rank0
from anyspeed.errors import UsageError, report
from anyspeed.layout import Layout
from anyspeed.training.run import freeze

Body = Callable[[InferenceRun, list], None]  # the run, this rank's model chunks


@dataclass(frozen=True)
class Command:
    """What an inference command adds to the runner: ``early(args)`` checks that need no
    tokenizer; ``complete(args, tok)`` fills in defaults at parse time (before the flags are
    frozen); ``check(args, model, tok)`` checks the rest and returns what it opened (the run's
    ``data``); ``body(run, chunks)`` does the work on every rank."""

    prog: str
    parser: argparse.ArgumentParser
    check: Callable[[argparse.Namespace, Any, Any], Any]
    body: Body
    early: Callable[[argparse.Namespace], None] | None = None
    complete: Callable[[argparse.Namespace, Any], None] | None = None


def load_tokenizer(args: argparse.Namespace):
    """The HF tokenizer ``--tokenizer-name-or-path`` (or the HF ``--load``) names."""
    from anyspeed.data.tokenizer import TokenizerSpec
    from anyspeed.data.tokenizer import load_tokenizer as load

    if not args.tokenizer_name_or_path:
        raise UsageError("--tokenizer-name-or-path is needed (the checkpoint holds no tokenizer)")
    spec = TokenizerSpec("PretrainedFromHF", args.tokenizer_name_or_path)
    spec.check()
    return load(spec)


def prepare(cmd: Command, argv: list[str]) -> InferenceRun:
    """Parse, complete, freeze and check ``argv`` (UsageError), before any process group."""
    args = training_flags.parse(cmd.parser, argv, cmd.prog)
    if args.bf16 and args.fp16:
        raise UsageError("--bf16 and --fp16 exclude each other")
    if cmd.early is not None:
        cmd.early(args)
    model, hf_dir = session.complete(args)
    training_flags.note(args, cmd.prog)
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.nproc_per_node not in (None, world):
        raise UsageError(
            f"--nproc-per-node {args.nproc_per_node} must equal TP x PP = {world} "
            "(inference runs one model copy)"
        )
    launched = int(os.environ.get("WORLD_SIZE", world))
    if launched != world:
        raise UsageError(f"{launched} ranks were launched for TP x PP = {world}")
    tok = load_tokenizer(args)
    vocab = session.language(model).vocab_size
    if tok.vocab_size > vocab:
        raise UsageError(
            f"the tokenizer's {tok.vocab_size} tokens do not fit the checkpoint's "
            f"vocabulary of {vocab}: wrong --tokenizer-name-or-path?"
        )
    if cmd.complete is not None:
        cmd.complete(args, tok)
    freeze(args)
    data = cmd.check(args, model, tok)
    load = args.load
    if hf_dir:  # every check passed: now the (cached) conversion
        load = session.materialize(args, hf_dir, cmd.prog)
        model = session.model_of(load)
    layout = Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size)
    return InferenceRun(cmd.prog, args, model, layout, load, hf_dir, tok, data)


def run(cmd: Command, argv: Sequence[str]) -> int:
    """Parse, check, launch or run ``cmd.body`` on every rank (``-h`` / ``--help`` prints the
    parser's help)."""
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        cmd.parser.print_help()
        return 0
    under_launcher = "WORLD_SIZE" in os.environ
    try:
        run = prepare(cmd, argv)
    except (UsageError, ValueError) as exc:  # TaskDataError and the readers' errors too
        return report(cmd.prog, exc) if is_rank0() else 2
    world = run.layout.tp * run.layout.pp
    if not under_launcher and world > 1:
        from anyspeed.launch import supervise, torchrun_command, torchrun_env

        line = torchrun_command(world, "anyspeed", [cmd.prog.split()[-1], *argv])
        return supervise(line, torchrun_env(world), cmd.prog)
    if under_launcher:
        return _run_here(run, cmd.body)
    from anyspeed import adaptor
    from anyspeed.launch import single_process_env

    # one process, maybe a caller's (a notebook, a test): leave its environment, parallel state
    # and patches as they were
    saved, patched = dict(os.environ), adaptor.state() is not None
    os.environ.update(single_process_env())
    try:
        return _run_here(run, cmd.body)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if not patched:
            adaptor.undo()


def _run_here(run: InferenceRun, body: Body) -> int:
    import torch.distributed as dist

    from anyspeed import adaptor
    from anyspeed.distributed.groups import init_distributed

    adaptor.apply(argv=[])
    args = run.args
    try:
        init_distributed(run.layout, args.seed)
        lora = getattr(args, "lora_load", None)
        model = session.load_model(run.load, run.model, run.layout, args.bf16, args.fp16, lora)
        body(run, model)
    except (UsageError, ValueError) as exc:
        return report(run.prog, exc, code=1) if is_rank0() else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
