"""``anyspeed pretrain``: GPT pretraining on megatron.core with Megatron-LM's flags, on any device.

The command line is parsed and checked once (before any process group), the adaptor is applied
with that namespace, and the run is the pretraining task on the training step, driven by the
loop with its hooks. Megatron's GPTDataset feeds Megatron's pipeline schedules, DDP,
(distributed) optimizer and OptimizerParamScheduler; checkpoints are atomic dist_checkpointing
saves that resume exactly, also under another layout. Launch it with torchrun
(``torchrun -m anyspeed pretrain ...``) or with ``--nproc-per-node N``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from anyspeed.checkpoint.errors import CheckpointError
from anyspeed.errors import UsageError, report
from anyspeed.training import stall
from anyspeed.training.arguments import parse_pretrain_args
from anyspeed.training.checks import check_args
from anyspeed.training.distributed import is_rank0, set_timeout
from anyspeed.training.hooks import NonFiniteLoss, print0
from anyspeed.training.loop import DataExhausted, Hook

PROG = "anyspeed pretrain"


def build_scheduler(optimizer: Any, args: argparse.Namespace):
    """Megatron's OptimizerParamScheduler, stepped in samples as Megatron-LM does."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    g = args.global_batch_size
    decay_iters = args.lr_decay_iters or args.train_iters
    warmup = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay_iters)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup * g,
        lr_decay_steps=max(decay_iters * g, warmup * g + 1),
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=max(args.train_iters * g, 1),
        wd_incr_style="constant",
        wsd_decay_steps=(args.lr_wsd_decay_iters or 0) * g or None,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def _banner(args: argparse.Namespace, start: int, dp: int) -> str:
    from anyspeed.device import detect

    m, lay = args.model_config, args.layout
    moe = ""
    if m.is_moe:
        moe = f"EP={lay.ep} ETP={lay.expert_tp} "
    experts = f", {m.num_experts} experts top-{m.moe_router_topk}" if m.is_moe else ""
    prog = getattr(args, "prog", "anyspeed pretrain")
    return (
        f"{prog}: {detect().type} x{os.environ.get('WORLD_SIZE', '1')} | "
        f"TP={lay.tp} PP={lay.pp} CP={lay.cp} DP={dp} {moe}VPP={lay.chunks} "
        f"SP={lay.sequence_parallel} distopt={lay.distributed_optimizer} | {m.num_layers} "
        f"layers{experts}, hidden {m.hidden_size}, vocab {m.vocab_size}, seq {args.seq_length} | "
        f"{args.train_config.precision} | iterations {start}->{args.train_iters}"
    )


def _load(args: argparse.Namespace, trainer: Any, scheduler: Any, state: Any,
          root: str | None = None) -> None:  # fmt: skip
    """Resume from ``root`` (default ``--load``): weights, optimizer, scheduler, position."""
    from anyspeed.checkpoint import save_load as ckpt

    root = root or args.load
    common = ckpt.load_checkpoint(root, trainer.model, trainer.optimizer, scheduler,
                                  finetune=args.finetune and root == args.load,
                                  load_optim=not args.no_load_optim,
                                  load_rng=not args.no_load_rng)  # fmt: skip
    state.iteration = int(common.get("iteration", 0))
    state.consumed = int(common.get("consumed_train_samples",
                                    state.iteration * args.global_batch_size))  # fmt: skip
    state.consumed_valid = int(common.get("consumed_valid_samples", 0))
    print0(f"anyspeed pretrain: loaded {root} at iteration {state.iteration}")


def train(args: argparse.Namespace, extra_hooks: Sequence[Hook] = (), task: Any = None,
          transforms: Sequence[Any] = (), load: Any = None) -> dict[str, Any]:  # fmt: skip
    """Run pretraining (or ``task``) for checked ``args`` in this process (one rank of the job).

    Returns the history (per-iteration losses, grad norms, learning rates, validation losses)
    with the trainer under ``"trainer"``. ``extra_hooks`` run after the built-in ones;
    ``transforms`` change the model before DDP (LoRA); ``load(args, trainer, scheduler,
    state)`` replaces the ``--load`` step.
    """
    import torch

    from anyspeed.checkpoint.record import model_record
    from anyspeed.device import peak_flops, torch_device
    from anyspeed.device.flops import slow_precision_warning
    from anyspeed.training import hooks as H
    from anyspeed.training.loop import LoopState, run
    from anyspeed.training.memory_hook import SavedBytesHook
    from anyspeed.training.metrics import peak_memory_bytes
    from anyspeed.training.step import Trainer
    from anyspeed.training.tasks import PretrainTask

    set_timeout(args.distributed_timeout_minutes)
    task = task or PretrainTask()
    trainer = Trainer(args.model_config, args.layout, args.train_config, task, transforms)
    scheduler = build_scheduler(trainer.optimizer, args)
    state = LoopState(trainer, scheduler, args.train_iters, args.global_batch_size,
                      fp16=args.fp16)  # fmt: skip
    if load is not None:
        load(args, trainer, scheduler, state)
    elif args.load:
        _load(args, trainer, scheduler, state)
    if args.mock_data:  # mock datasets have nothing to cache; Megatron warns per split
        import logging

        logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)
    train_ds, valid_ds, test_ds = task.datasets(args)
    device = torch_device()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.train_config.precision,
                                                               torch.float32)  # fmt: skip
    peak = peak_flops(dtype) * int(os.environ.get("WORLD_SIZE", "1"))
    print0(_banner(args, state.iteration, trainer.dp))
    prog = getattr(args, "prog", "anyspeed pretrain")
    slow = slow_precision_warning(dtype)  # e.g. bf16 on a CPU without bf16 matmul kernels
    if slow:
        print0(f"{prog}: warning: {slow}")
    reporter = H.Reporter(args, state.iteration)
    hooks = [
        SavedBytesHook(prog),  # first: it prints before the progress bar is drawn
        H.NanGuard(args.save),
        H.LogHook(reporter, args, args.model_config.flops_per_token(args.seq_length), peak),
        H.EvalHook(reporter, args, task, valid_ds, test_ds, device),
        H.CheckpointHook(
            args,
            {**model_record(args.model_config), **getattr(args, "checkpoint_extra", {})},
        ),  # fmt: skip
        *extra_hooks,
    ]
    try:
        run(state, task.batches(train_ds, args, state.consumed, device), hooks)
    finally:
        reporter.close()
    history = state.history
    history["trainer"] = trainer
    history["peak_memory_bytes"] = peak_memory_bytes()
    return history


def prepare(argv: list[str], where: str | None = None, parse: Any = parse_pretrain_args,
            check: Any = check_args) -> tuple[argparse.Namespace, list[str]]:  # fmt: skip
    """Parse and check a command line (UsageError on any problem), before process groups.

    ``--load <HF dir>`` brings the architecture and tokenizer flags from the directory and
    converts its weights (once); the returned argv names the converted checkpoint. ``where``
    is "launcher" when no launcher set WORLD_SIZE (the world is --nproc-per-node).
    """
    from anyspeed.argv import set_flag
    from anyspeed.training import hf_load

    hf_dir = hf_load.hf_dir_of(argv)
    if hf_dir:
        argv = hf_load.expand(argv, hf_dir)
    args = parse(argv)
    world = (args.nproc_per_node or 1) if where == "launcher" else int(os.environ["WORLD_SIZE"])
    check(args, world)
    if hf_dir:
        args.load = hf_load.convert(argv, hf_dir)
        argv = set_flag(argv, "--load", args.load)
    return args, argv


def _launch(args: argparse.Namespace, argv: list[str], command: str = "pretrain") -> int:
    """Start ``--nproc-per-node`` local ranks with torchrun (flags already checked); a signal
    to this process ends torchrun and every rank (exit 128 + signal, one line)."""
    from anyspeed.launch import supervise, torchrun_command, torchrun_env

    cmd = torchrun_command(args.nproc_per_node, "anyspeed", [command, *argv])
    return supervise(cmd, torchrun_env(args.nproc_per_node), f"anyspeed {command}")


def _sample(args: argparse.Namespace, history: dict[str, Any]) -> None:
    from anyspeed.inference.generate import generate_text

    text = generate_text(history["trainer"].model, args, args.generate_prompt,
                         args.generate_tokens)  # fmt: skip
    if text is not None:
        print0(f"\nprompt: {args.generate_prompt!r}\nsample: {text!r}")


def main(argv: Sequence[str] | None = None, command: str = "pretrain", prepare_fn: Any = prepare,
         train_fn: Any = None, help_fn: Any = None) -> int:  # fmt: skip
    """Entry point: parse, check (before any process group), launch or run, report.
    ``anyspeed posttrain`` runs through here with its own prepare/train functions."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = f"anyspeed {command}"
    if "-h" in argv or "--help" in argv:
        from anyspeed.training.arguments import build_parser

        (help_fn or build_parser)().print_help()
        return 0
    under_launcher = "WORLD_SIZE" in os.environ
    try:
        args, argv = prepare_fn(argv, None if under_launcher else "launcher")
    except UsageError as exc:
        return report(prog, exc) if is_rank0() else 2
    args.prog = prog  # the banner and warnings name the command that runs
    if not under_launcher and (args.nproc_per_node or 1) > 1:
        return _launch(args, argv, command)
    if not under_launcher:  # one process, no launcher: be rank 0 of a world of one
        from anyspeed.launch import single_process_env

        os.environ.update(single_process_env())
    from anyspeed import adaptor

    adaptor.apply(args)
    try:
        history = (train_fn or train)(args)
    except (NonFiniteLoss, CheckpointError, DataExhausted) as exc:  # rank 0 says why
        return report(prog, exc, code=1) if is_rank0() else 1
    except RuntimeError as exc:
        if not stall.is_timeout(exc):
            raise
        stall.exit_on_stall(prog, args.distributed_timeout_minutes)  # one line; exits
    if args.generate_prompt:
        _sample(args, history)
    losses = history["loss"]
    if losses:
        print0(f"{prog}: done, iteration {history['iterations'][-1]}, lm loss "
               f"{losses[0]:.4f} -> {losses[-1]:.4f}")  # fmt: skip
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
