"""The engine: one checked :class:`~anyspeed.training.run.Run` trained in this rank.

The stage's task supplies the data, forward step, loss and metrics (and any frozen models);
the trainer runs steps, the loop drives them with the hooks (logging, evaluation, checkpoints,
NaN guard). Megatron's schedules, DDP, (distributed) optimizer and OptimizerParamScheduler do
the work; checkpoints are atomic dist_checkpointing saves that resume under another layout.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from anyspeed.distributed.process import print0, rank, world_size
from anyspeed.training import manual_gc
from anyspeed.training.loop import Hook
from anyspeed.training.run import Run
from anyspeed.training.task import Task


def build_scheduler(optimizer: Any, run: Run):
    """Megatron's OptimizerParamScheduler, stepped in samples as Megatron-LM does."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = run.args
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


def banner(run: Run, start: int, dp: int) -> str:
    """The run's first line: device, layout, model, precision, iterations."""
    from anyspeed.device import detect

    m, lay = run.model, run.layout
    moe = f"EP={lay.ep} ETP={lay.expert_tp} " if m.is_moe else ""
    experts = f", {m.num_experts} experts top-{m.moe_router_topk}" if m.is_moe else ""
    stage = "" if run.stage == "pretrain" else f" --stage {run.stage}"
    if lay.noop_layers:  # the real layers per rank, where the slots put them
        experts += f" (+{len(lay.noop_layers)} noop: {lay.stage_layers(m.num_layers)} per rank)"
    elif lay.layer_list:
        experts += f" ({lay.stage_layers(m.num_layers)} per rank)"
    return (
        f"{run.prog}{stage}: {detect().type} x{os.environ.get('WORLD_SIZE', '1')} | "
        f"TP={lay.tp} PP={lay.pp} CP={lay.cp} DP={dp} {moe}{lay.schedule} "
        f"SP={lay.sequence_parallel} distopt={lay.distributed_optimizer} | {m.num_layers} "
        f"layers{experts}, hidden {m.hidden_size}, vocab {m.vocab_size}, seq {run.seq_length} | "
        f"{run.train.precision} | iterations {start}->{run.args.train_iters}"
    )


def mfu_line(prog: str, peak: Any) -> str:
    """Where MFU's denominator came from (a :class:`~anyspeed.device.flops.Peak`), or why
    there is no MFU: a figure is only as honest as its peak."""
    if peak.flops is None:
        return f"{prog}: MFU not shown: peak {peak.source}"
    return f"{prog}: MFU against {peak.flops / 1e12:.4g} TFLOP/s per process: {peak.source}"


def resume(
    run: Run,
    trainer: Any,
    scheduler: Any,
    state: Any,
    root: str | None = None,
    flag: str = "--load",
) -> None:
    """Resume from ``root`` (default: the run's checkpoint; ``flag`` names it in errors):
    weights, optimizer, scheduler, RNG and the data position."""
    from anyspeed.checkpoint.errors import CheckpointMismatch
    from anyspeed.checkpoint.load import load_checkpoint

    args = run.args
    root = root or run.load
    if run.layout.megatron_fsdp and _weights_into_megatron_fsdp(run, trainer, root, state):
        return
    try:
        common = load_checkpoint(
            root,
            trainer.model,
            trainer.optimizer,
            scheduler,
            finetune=args.finetune and root == run.load,
            load_optim=not args.no_load_optim,
            load_rng=not args.no_load_rng,
        )
    except CheckpointMismatch as exc:
        if root == run.load:
            raise
        raise CheckpointMismatch(str(exc).replace("--load ", f"{flag} ", 1)) from None
    state.iteration = int(common.get("iteration", 0))
    state.consumed = int(
        common.get("consumed_train_samples", state.iteration * args.global_batch_size)
    )
    state.consumed_valid = int(common.get("consumed_valid_samples", 0))
    print0(f"{run.prog}: loaded {root} at iteration {state.iteration}")


def _weights_into_megatron_fsdp(run: Run, trainer: Any, root: str, state: Any) -> bool:
    """A weights-only start of a Megatron-FSDP run from a torch_dist checkpoint (an HF
    ``--load``, ``--finetune``): whole tensors read, the rows each rank holds kept. False for
    its own (fsdp_dtensor) checkpoints, which load_checkpoint resumes."""
    from anyspeed.checkpoint.files import RELEASE
    from anyspeed.checkpoint.reads import checkpoint_format, tracked_dir
    from anyspeed.training import fsdp_weights

    it_dir = tracked_dir(root)
    if it_dir is None or checkpoint_format(it_dir) != "torch_dist":
        return False
    if not (run.args.finetune or os.path.basename(it_dir) == RELEASE):
        return False  # load_checkpoint says what to pass
    fsdp_weights.load_weights(it_dir, [m.module for m in trainer.model], run.model)
    state.iteration = state.consumed = state.consumed_valid = 0
    print0(f"{run.prog}: loaded the weights of {root} into Megatron-FSDP's shards")
    return True


def _start(run: Run, task: Task) -> tuple[Any, Any, Any]:
    """Trainer, scheduler and loop state, loaded; the task's frozen models built."""
    from anyspeed.distributed.groups import set_timeout
    from anyspeed.training.frozen import build_frozen
    from anyspeed.training.loop import LoopState
    from anyspeed.training.step import Trainer

    set_timeout(run.args.distributed_timeout_minutes)
    trainer = Trainer(run.model, run.layout, run.train, task)
    scheduler = build_scheduler(trainer.optimizer, run)
    state = LoopState(
        trainer, scheduler, run.args.train_iters, run.args.global_batch_size, fp16=run.train.fp16
    )
    if not task.load(run, trainer, scheduler, state) and run.load:
        resume(run, trainer, scheduler, state)
    trainer.frozen = build_frozen(trainer, task.frozen_models())
    task.setup(trainer)
    return trainer, scheduler, state


def train(run: Run, task: Task, extra_hooks: Sequence[Hook] = ()) -> dict[str, Any]:
    """Train checked ``run`` on ``task`` in this process (one rank of the job).

    Returns the history (per-iteration losses, metrics, grad norms, learning rates,
    validation losses) with the trainer under ``"trainer"``. ``extra_hooks`` run after the
    built-in ones.
    """
    import torch

    from anyspeed.checkpoint.record import hf_vocab_record, model_record
    from anyspeed.device import torch_device
    from anyspeed.device.flops import peak, slow_precision_warning
    from anyspeed.training import hooks as H
    from anyspeed.training.loop import run as run_loop
    from anyspeed.training.memory_hook import SavedBytesHook
    from anyspeed.training.metrics import peak_memory_bytes
    from anyspeed.training.sharding import settle

    trainer, scheduler, state = _start(run, task)
    if run.args.mock_data:  # mock datasets have nothing to cache; Megatron warns per split
        import logging

        logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)
    train_ds, valid_ds, test_ds = task.datasets(run)
    device = torch_device()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.train.precision, torch.float32)
    denominator = peak(dtype)
    print0(banner(run, state.iteration, trainer.dp))
    print0(mfu_line(run.prog, denominator))
    slow = slow_precision_warning(dtype)  # e.g. bf16 on a CPU without bf16 matmul kernels
    if slow:
        print0(f"{run.prog}: warning: {slow}")
    if run.train.fp8:
        from anyspeed.features.fp8.linear import describe

        print0(describe(run.prog, trainer.model, run.train.fp8))
    reporter = H.Reporter(run.args, state.iteration)
    hooks = [
        SavedBytesHook(run.prog),  # first: it prints before the progress bar is drawn
        H.NanGuard(run.args.save),
        H.LogHook(
            reporter,
            run,
            run.model.flops_per_token(run.seq_length),
            None if denominator.flops is None else denominator.flops * world_size(),
            task.loss_key,
        ),
        H.EvalHook(reporter, run, task, valid_ds, test_ds, device),
        H.CheckpointHook(
            run,
            {
                **model_record(run.model),
                **hf_vocab_record(run.load),
                "anyspeed_stage": run.stage,
                **run.records,
                **task.records(),
            },
        ),
        *task.hooks(run),
        *_profile(run),
        *_export(run),
        *manual_gc.hooks(run.args),
        *extra_hooks,
    ]
    try:
        run_loop(state, task.batches(train_ds, run, state.consumed, device, trainer), hooks)
    finally:
        reporter.close()
    settle(trainer.model)
    history = state.history
    history["trainer"] = trainer
    history["peak_memory_bytes"] = peak_memory_bytes()
    return history


def _export(run: Run) -> list[Hook]:
    """The Hugging Face export after each save (``--enable-mg2hf-convert``)."""
    from anyspeed.training.hf_export import HFExport

    if run.export is None:
        return []
    return [HFExport(run, run.export, getattr(run.config, "lora", None))]


def _profile(run: Run) -> list[Hook]:
    """``--profile``'s hook on this rank when it is one of ``--profile-ranks``."""
    from anyspeed.training.profile_hook import ProfileHook

    a = run.args
    if not getattr(a, "profile", False) or rank() not in a.profile_ranks:
        return []
    out = a.tensorboard_dir or a.save
    return [ProfileHook(run.prog, a.profile_step_start, a.profile_step_end, out)]
