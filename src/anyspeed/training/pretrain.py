"""``anyspeed pretrain``: GPT pretraining on megatron.core with Megatron-LM's flags, on any device.

Megatron's GPTDataset and BlendedMegatronDatasetBuilder feed Megatron's pipeline schedules, DDP,
(distributed) optimizer and OptimizerParamScheduler; checkpoints are atomic dist_checkpointing
saves that resume exactly, also under another TP/PP/DP layout. Launch it with torchrun, or with
``--nproc-per-node N`` to have anyspeed start torchrun on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from anyspeed.training.arguments import UsageError, check_args, parse_pretrain_args


def spec_layout_config(args: argparse.Namespace):
    """The engine's (GPTSpec, Layout, TrainConfig) for checked pretraining ``args``."""
    from anyspeed.training.engine import GPTSpec, Layout, TrainConfig

    spec = GPTSpec(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=args.padded_vocab_size,
        seq_length=args.seq_length,
        swiglu=args.swiglu,
        normalization=args.normalization,
        position_embedding_type=args.position_embedding_type,
        untie_embeddings=args.untie_embeddings_and_output_weights,
        init_method_std=args.init_method_std,
        add_qkv_bias=args.add_qkv_bias,
        rotary_base=args.rotary_base,
        kv_channels=args.kv_channels,
        qk_layernorm=args.qk_layernorm,
        norm_epsilon=args.norm_epsilon,
        add_bias_linear=not args.disable_bias_linear,
        max_position_embeddings=args.max_position_embeddings,
        rotary_percent=args.rotary_percent,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
    )
    from anyspeed.features.context_parallel.feature import ALGO_TO_COMM

    algo = ALGO_TO_COMM.get(getattr(args, "context_parallel_algo", "megatron_cp_algo"), "p2p")
    layout = Layout(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        cp=getattr(args, "context_parallel_size", 1) or 1,
        cp_algo=algo,
        ulysses_degree=getattr(args, "ulysses_degree_in_cp", None),
        vpp=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        bucket_size=args.ddp_bucket_size,
    )
    cfg = TrainConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        seed=args.seed,
        bf16=args.bf16,
        fp16=args.fp16,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        optimizer=args.optimizer,
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
    )
    return spec, layout, cfg


def build_scheduler(optimizer: Any, args: argparse.Namespace):
    """Megatron's OptimizerParamScheduler, stepped in samples as Megatron-LM does."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    g = args.global_batch_size
    decay_iters = args.lr_decay_iters or args.train_iters
    warmup = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay_iters)
    decay_steps = max(decay_iters * g, warmup * g + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup * g,
        lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=max(args.train_iters * g, 1),
        wd_incr_style="constant",
        wsd_decay_steps=(args.lr_wsd_decay_iters or 0) * g or None,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite: the run stops without saving over good checkpoints."""


def _print0(*parts: Any) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(*parts, flush=True)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run pretraining for checked ``args`` in this process (one rank of the job).

    Returns the history: per-iteration losses/grad norms/learning rates and validation losses.
    """
    from anyspeed.device import detect, peak_flops, torch_device
    from anyspeed.training import checkpointing as ckpt
    from anyspeed.training.data import batches, build_datasets
    from anyspeed.training.engine import Trainer
    from anyspeed.training.metrics import (
        Progress,
        TensorBoard,
        model_flops_per_token,
        peak_memory_bytes,
    )

    spec, layout, cfg = spec_layout_config(args)
    trainer = Trainer(spec, layout, cfg)
    scheduler = build_scheduler(trainer.optimizer, args)
    start_iter, consumed, consumed_valid = 0, 0, 0
    if args.load:
        common = ckpt.load_checkpoint(
            args.load,
            trainer.model,
            trainer.optimizer,
            scheduler,
            finetune=args.finetune,
            load_optim=not args.no_load_optim,
            load_rng=not args.no_load_rng,
        )
        start_iter = int(common.get("iteration", 0))
        consumed = int(common.get("consumed_train_samples", start_iter * args.global_batch_size))
        consumed_valid = int(common.get("consumed_valid_samples", 0))
        _print0(f"anyspeed pretrain: loaded {args.load} at iteration {start_iter}")
    trainer.iteration = start_iter
    if args.mock_data:  # mock datasets have nothing to cache; Megatron warns per split
        import logging

        logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)
    train_ds, valid_ds, test_ds = build_datasets(args)
    device = torch_device()
    train_iter = batches(train_ds, args, consumed, device)
    valid_iter = batches(valid_ds, args, consumed_valid, device) if valid_ds else None

    info = detect()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    peak = peak_flops(dtype) * world
    flops_tok = model_flops_per_token(spec)
    tokens_per_iter = args.global_batch_size * args.seq_length
    tb = TensorBoard(args.tensorboard_dir if int(os.environ.get("RANK", "0")) == 0 else None)
    history: dict[str, Any] = {"iterations": [], "loss": [], "grad_norm": [], "lr": [],
                               "valid": [], "saved": [], "skipped": [],
                               "loss_scale": []}  # fmt: skip
    _print0(
        f"anyspeed pretrain: {info.type} x{world} | TP={layout.tp} PP={layout.pp} "
        f"CP={layout.cp} DP={trainer.dp} VPP={layout.vpp or 1} SP={layout.sequence_parallel} "
        f"distopt={layout.distributed_optimizer} | {spec.num_layers} layers, hidden "
        f"{spec.hidden_size}, vocab {spec.vocab_size}, seq {spec.seq_length} | "
        f"{'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'} | "
        f"iterations {start_iter}->{args.train_iters}"
    )

    def evaluate(label: str, it: int, source) -> float | None:
        if source is None or not args.eval_iters:
            return None
        losses = []
        for _ in range(args.eval_iters):
            mbs = next(source, None)
            if mbs is None:
                break
            losses.append(trainer.evaluate(mbs))
        if not losses:
            return None
        loss = sum(losses) / len(losses)
        ppl = math.exp(min(loss, 20.0))
        _print0(f" {label} loss at iteration {it} | lm loss value: {loss:.6E} | "
                f"lm loss PPL: {ppl:.6E}")  # fmt: skip
        tb.scalars({f"lm-loss-{label.split()[0]}": loss}, it)
        return loss

    def save(it: int) -> None:
        extra = {
            "consumed_train_samples": consumed,
            "consumed_valid_samples": consumed_valid,
            "anyspeed_args": _model_args(args),
        }
        t = time.perf_counter()
        optimizer = None if args.no_save_optim else trainer.optimizer
        path = ckpt.save_checkpoint(args.save, it, trainer.model, optimizer, scheduler, extra)
        history["saved"].append(it)
        _print0(f" saved checkpoint {path} ({time.perf_counter() - t:.1f} s)")

    metrics = None
    if args.metrics_file and int(os.environ.get("RANK", "0")) == 0:
        metrics = open(args.metrics_file, "a")
    progress = Progress(args.train_iters, start_iter, enabled=not args.no_progress_bar)
    interval_loss, interval_n, t0 = 0.0, 0, time.perf_counter()
    last_saved = start_iter if args.load and not args.finetune else None
    it = start_iter
    while it < args.train_iters:
        mbs = next(train_iter, None)
        if mbs is None:
            raise RuntimeError(f"training data exhausted at iteration {it} (check --split)")
        out = trainer.step(mbs)
        it += 1
        scheduler.step(increment=args.global_batch_size)
        consumed += args.global_batch_size
        if not math.isfinite(out["loss"]):
            progress.clear()
            good = ckpt.read_latest(args.save) if args.save else None
            raise NonFiniteLoss(
                f"loss is {out['loss']} at iteration {it}; stopping without saving"
                + (f" (last good checkpoint: iteration {good} in {args.save})" if good else "")
            )
        lr = trainer.optimizer.param_groups[0]["lr"]
        history["iterations"].append(it)
        history["loss"].append(out["loss"])
        history["grad_norm"].append(out["grad_norm"])
        history["lr"].append(lr)
        if not out["ok"]:  # fp16 overflow: Megatron skipped the update and lowered the scale
            history["skipped"].append(it)
        if args.fp16:
            history["loss_scale"].append(float(trainer.optimizer.get_loss_scale()))
        interval_loss += out["loss"]
        interval_n += 1
        progress.update(it)
        if it % args.log_interval == 0 or it == args.train_iters:
            dt = (time.perf_counter() - t0) / interval_n
            tps = tokens_per_iter / dt
            tflops = tps * flops_tok / 1e12
            mem = peak_memory_bytes() / 2**30
            scale = float(trainer.optimizer.get_loss_scale()) if args.fp16 else None
            progress.clear()
            _print0(
                f" iteration {it:>7d}/{args.train_iters} | consumed samples {consumed:>9d} | "
                f"elapsed time per iteration (ms): {dt * 1000:.1f} | learning rate: {lr:.6E} | "
                f"lm loss: {interval_loss / interval_n:.6E} | "
                + (f"loss scale: {scale:.1f} | " if scale is not None else "")
                + f"grad norm: {out['grad_norm']:.3f} | tokens/s: {tps:,.0f} | "
                f"TFLOP/s: {tflops:.3f} | MFU: {100 * tflops * 1e12 / peak:.1f}% | "
                f"peak mem: {mem:.2f} GiB/rank | {progress.tag(it)}"
            )
            record = {"iteration": it, "lm_loss": interval_loss / interval_n, "lr": lr,
                      "skipped": len(history["skipped"]),
                      "grad_norm": out["grad_norm"], "tokens_per_s": tps, "tflops": tflops,
                      "mfu": tflops * 1e12 / peak, "peak_mem_gib": mem,
                      "ms_per_iter": dt * 1000}  # fmt: skip
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            tb.scalars({"lm-loss": interval_loss / interval_n, "learning-rate": lr,
                        "grad-norm": out["grad_norm"], "tokens-per-sec": tps,
                        "tflops": tflops, "mfu": tflops * 1e12 / peak,
                        "mem-peak-gib": mem}, it)  # fmt: skip
            interval_loss, interval_n, t0 = 0.0, 0, time.perf_counter()
        if args.eval_interval and it % args.eval_interval == 0 and it != args.train_iters:
            v = evaluate("validation", it, valid_iter)
            if v is not None:
                history["valid"].append((it, v))
                consumed_valid += args.eval_iters * args.global_batch_size
        if args.save and args.save_interval and it % args.save_interval == 0:
            save(it)
            last_saved = it
        if args.exit_interval and it % args.exit_interval == 0:
            break
    progress.clear()
    if it == args.train_iters and args.train_iters > start_iter:
        v = evaluate("validation", it, valid_iter)
        if v is not None:
            history["valid"].append((it, v))
            consumed_valid += args.eval_iters * args.global_batch_size
        if test_ds is not None:
            t = evaluate("test", it, batches(test_ds, args, 0, device))
            history["test"] = t
    if args.save and last_saved != it:
        save(it)
    tb.close()
    if metrics is not None:
        metrics.close()
    history["trainer"] = trainer
    history["peak_memory_bytes"] = peak_memory_bytes()
    return history


def _model_args(args: argparse.Namespace) -> dict[str, Any]:
    """Architecture flags stored with a checkpoint (informational; plain values only)."""
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "kv_channels", "padded_vocab_size", "seq_length",
            "max_position_embeddings", "swiglu", "normalization", "position_embedding_type",
            "rotary_base", "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights",
            "disable_bias_linear", "norm_epsilon", "global_batch_size")  # fmt: skip
    return {k: getattr(args, k) for k in keys}


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``--nproc-per-node`` local ranks with torchrun (flags already checked)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.nproc_per_node}", "-m", "anyspeed.training.pretrain", *argv,
    ]  # fmt: skip
    return subprocess.call(cmd)


def prepare(argv: list[str], where: str | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Parse and check a command line (UsageError on any problem), before process groups.

    ``--load <HF dir>`` brings the architecture and tokenizer flags from the directory and
    converts its weights (once); the returned argv names the converted checkpoint. ``where``
    is "launcher" when no launcher set WORLD_SIZE (the world is --nproc-per-node).
    """
    from anyspeed.training import hf_load

    hf_dir = hf_load.hf_dir_of(argv)
    if hf_dir:
        argv = hf_load.expand(argv, hf_dir)
    args = parse_pretrain_args(argv)
    world = (args.nproc_per_node or 1) if where == "launcher" else int(os.environ["WORLD_SIZE"])
    check_args(args, world)
    if hf_dir:
        args.load = hf_load.convert(argv, hf_dir)
        argv = hf_load.set_flag(argv, "--load", args.load)
        args._argv = argv
    return args, argv


def _quiet_known_notices() -> None:
    """Megatron's notices that are expected on the portable path (no TE/apex) would repeat on
    every rank; anyspeed's own log line says which kernels are in use."""
    import warnings

    for pattern in (r".*(Apex|Transformer Engine).* not installed", r"full scope is deprecated"):
        warnings.filterwarnings("ignore", message=pattern)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, check (before any process group), launch or run, report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_known_notices()
    if "-h" in argv or "--help" in argv:
        from anyspeed.training.arguments import build_parser

        build_parser().print_help()
        return 0
    rank = int(os.environ.get("RANK", "0"))
    under_launcher = "WORLD_SIZE" in os.environ
    try:
        args, argv = prepare(argv, None if under_launcher else "launcher")
    except UsageError as exc:
        if rank == 0:
            print(f"anyspeed pretrain: error: {exc}", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", args.nproc_per_node or 1))
    if not under_launcher and world > 1:
        return _launch(args, argv)
    if not under_launcher:  # one process, no launcher: be rank 0 of a world of one
        from anyspeed.testing import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))  # fmt: skip
    import anyspeed.megatron_adaptor as adaptor

    adaptor.apply(argv=args._argv)
    try:
        history = train(args)
    except NonFiniteLoss as exc:
        if rank == 0:
            print(f"anyspeed pretrain: error: {exc}", file=sys.stderr)
        return 1
    if args.generate_prompt:
        from anyspeed.training.generate import generate_text

        text = generate_text(history["trainer"], args, args.generate_prompt,
                             args.generate_tokens)  # fmt: skip
        if rank == 0 and text is not None:
            print(f"\nprompt: {args.generate_prompt!r}\nsample: {text!r}", flush=True)
    losses = history["loss"]
    if losses and rank == 0:
        print(f"anyspeed pretrain: done, iteration {history['iterations'][-1]}, lm loss "
              f"{losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)  # fmt: skip
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
