"""The life of an inference command: parse and check (before any process group), launch
``TP x PP`` ranks with torchrun when asked, load the model, run the body, report errors in one
line. ``anyspeed generate`` and ``anyspeed evaluate`` differ only in their flags and body."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

from anyspeed.commands import session
from anyspeed.distributed.process import is_rank0
from anyspeed.errors import UsageError, report

Body = Callable[[argparse.Namespace, list, Any, Any], None]  # args, model, config, tokenizer




def load_tokenizer(args: argparse.Namespace):
    """The HF tokenizer ``--tokenizer-name-or-path`` (or the HF ``--load``) names."""
    from anyspeed.data.tokenizer import TokenizerSpec
    from anyspeed.data.tokenizer import load_tokenizer as load

    if not args.tokenizer_name_or_path:
        raise UsageError("--tokenizer-name-or-path is needed (the checkpoint holds no tokenizer)")
    spec = TokenizerSpec("PretrainedFromHF", args.tokenizer_name_or_path)
    spec.check()
    return load(spec)


def _prepare(parser: argparse.ArgumentParser, argv: list[str],
             check: Callable[[argparse.Namespace, Any], None], prog: str):  # fmt: skip
    args = parser.parse_args(argv)
    if args.bf16 and args.fp16:
        raise UsageError("--bf16 and --fp16 exclude each other")
    model = session.resolve(args)
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.nproc_per_node not in (None, world):
        raise UsageError(f"--nproc-per-node {args.nproc_per_node} must equal TP x PP = {world} "
                         "(inference runs one model copy)")  # fmt: skip
    launched = int(os.environ.get("WORLD_SIZE", world))
    if launched != world:
        raise UsageError(f"{launched} ranks were launched for TP x PP = {world}")
    tok = load_tokenizer(args)
    if tok.vocab_size > model.vocab_size:
        raise UsageError(f"the tokenizer's {tok.vocab_size} tokens do not fit the checkpoint's "
                         f"vocabulary of {model.vocab_size}: wrong "
                         "--tokenizer-name-or-path?")  # fmt: skip
    check(args, tok)
    if args.hf_dir:  # every check passed: now the (cached) conversion
        model = session.materialize(args, argv, prog)
    return args, model, tok


def run(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str],
        check: Callable[[argparse.Namespace, Any], None], body: Body) -> int:  # fmt: skip
    """Parse, check, launch or run ``body(args, model chunks, model config, tokenizer)``
    (``-h`` / ``--help`` prints the parser's help)."""
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        return 0
    under_launcher = "WORLD_SIZE" in os.environ
    try:
        args, config, tok = _prepare(parser, argv, check, prog)
    except (UsageError, ValueError) as exc:  # TaskDataError and the readers' errors too
        return report(prog, exc) if is_rank0() else 2
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if not under_launcher and world > 1:
        from anyspeed.launch import supervise, torchrun_command, torchrun_env

        cmd = torchrun_command(world, "anyspeed", [prog.split()[-1], *argv])
        return supervise(cmd, torchrun_env(world), prog)
    if not under_launcher:
        from anyspeed.launch import single_process_env

        os.environ.update(single_process_env())
    return _run_here(prog, args, config, tok, body)


def _run_here(prog: str, args: argparse.Namespace, config: Any, tok: Any, body: Body) -> int:
    import torch.distributed as dist

    from anyspeed import adaptor
    from anyspeed.distributed.groups import init_distributed
    from anyspeed.layout import Layout

    adaptor.apply(argv=[])
    layout = Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size)
    try:
        init_distributed(layout, args.seed)
        model = session.load_model(args.load, config, layout, bf16=args.bf16, fp16=args.fp16)
        body(args, model, config, tok)
    except (UsageError, ValueError) as exc:
        return report(prog, exc, code=1) if is_rank0() else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
