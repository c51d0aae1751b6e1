"""Smoke pretraining run: a tiny GPT on megatron.core at a chosen layout, under torchrun.

Logs iteration, loss, grad norm, tokens/s, TFLOP/s, MFU (against the device layer's peak) and
peak memory, and fails (exit 1) unless the loss is finite and falls.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence

import torch

from anyspeed.training.metrics import model_flops_per_token


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="anyspeed smoke")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bf16", action="store_true")
    args, _ = p.parse_known_args(list(argv))  # anyspeed's own flags are the adaptor's
    return args


def spec_and_layout(args: argparse.Namespace):
    """The model and layout the smoke run's flags describe."""
    from anyspeed.training.engine import GPTSpec, Layout

    vpp = None
    if args.num_layers_per_virtual_pipeline_stage:
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        vpp = per_stage // args.num_layers_per_virtual_pipeline_stage
    spec = GPTSpec(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=4 * args.hidden_size,
        vocab_size=256,
        seq_length=args.seq_length,
    )
    layout = Layout(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        vpp=vpp,
        sequence_parallel=args.sequence_parallel,
        distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
    )
    return spec, layout


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import anyspeed.megatron_adaptor as adaptor
    from anyspeed.device import cpu_cuda, detect, peak_flops
    from anyspeed.training.engine import TrainConfig, Trainer

    args = parse(argv)
    adaptor.apply(argv=argv)
    rank = int(os.environ.get("RANK", "0"))
    spec, layout = spec_and_layout(args)
    cfg = TrainConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        lr=args.lr,
        bf16=args.bf16,
    )
    try:
        trainer = Trainer(spec, layout, cfg)
    except ValueError as exc:  # layout problems, raised before any process group starts
        print(f"anyspeed: error: {exc}", file=sys.stderr)
        return 2
    device = detect()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    peak = peak_flops(torch.bfloat16 if args.bf16 else torch.float32) * world
    flops_tok = model_flops_per_token(spec)
    tokens_per_iter = cfg.global_batch_size * spec.seq_length
    if rank == 0:
        print(
            f"anyspeed smoke: {device.type} x{world}, TP={layout.tp} PP={layout.pp} "
            f"DP={trainer.dp} SP={layout.sequence_parallel} "
            f"distopt={layout.distributed_optimizer}, {spec.num_layers} layers "
            f"h={spec.hidden_size} seq={spec.seq_length}",
            flush=True,
        )
    losses = []
    t0 = time.perf_counter()
    for it in range(1, args.train_iters + 1):
        out = trainer.step()
        losses.append(out["loss"])
        if it % args.log_interval == 0 or it == args.train_iters:
            dt = (time.perf_counter() - t0) / args.log_interval
            t0 = time.perf_counter()
            tps = tokens_per_iter / dt
            tflops = tps * flops_tok / 1e12
            if rank == 0:
                print(
                    f" iteration {it:5d}/{args.train_iters} | loss {out['loss']:.4f} | "
                    f"grad norm {out['grad_norm']:.3f} | {dt * 1000:.0f} ms/iter | "
                    f"{tps:,.0f} tokens/s | {tflops:.3f} TFLOP/s | "
                    f"MFU {100 * tflops * 1e12 / peak:.1f}% | peak mem "
                    f"{cpu_cuda.max_memory_allocated() / 2**20:.0f} MiB/rank"
                    if device.is_cpu
                    else f" iteration {it} | loss {out['loss']:.4f} | {tps:,.0f} tokens/s",
                    flush=True,
                )
    ok = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    if rank == 0:
        print(
            f"anyspeed smoke: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
            f"({'falling, OK' if ok else 'NOT falling'})",
            flush=True,
        )
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
