"""Tokens/s and peak RSS per rank of one tiny GPT at DP2, TP2 and PP2 on 2 CPU processes.

All three layouts run in one invocation, one after another, on the same model, data and
thread budget, so the printed ratios are comparable even on a noisy shared machine.

    python benchmarks/layouts.py [--steps 8] [--hidden-size 256] [--seq-length 256]
"""

from __future__ import annotations

import argparse
import time

from anyspeed.testing import run_distributed

LAYOUTS = {
    "DP2": dict(),
    "DP2+distopt": dict(distributed_optimizer=True, overlap_grad_reduce=True),
    "TP2": dict(tp=2),
    "TP2+SP": dict(tp=2, sequence_parallel=True),
    "PP2": dict(pp=2),
}


def bench(layout: dict, steps: int, warmup: int, spec: dict, cfg: dict) -> dict:
    import torch

    from anyspeed.device import cpu_cuda
    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig
    from anyspeed.stages.pretrain.task import PretrainTask
    from anyspeed.training.config import TrainConfig
    from anyspeed.training.step import Trainer
    from anyspeed.training.synthetic import train_step

    seq = spec.pop("seq_length", 32)
    t = Trainer(
        ModelConfig(**spec), Layout(**layout), TrainConfig(seq_length=seq, **cfg), PretrainTask()
    )
    for _ in range(warmup):
        train_step(t)
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        train_step(t)
    torch.distributed.barrier()
    elapsed = time.perf_counter() - start
    tokens = steps * t.cfg.global_batch_size * t.cfg.seq_length
    return {
        "tokens_per_s": tokens / elapsed,
        "peak_rss_mib": cpu_cuda.max_memory_allocated() / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--global-batch-size", type=int, default=8)
    a = p.parse_args()
    spec = dict(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=8,
        ffn_hidden_size=4 * a.hidden_size,
        vocab_size=4096,
        seq_length=a.seq_length,
    )
    cfg = dict(micro_batch_size=2, global_batch_size=a.global_batch_size)
    rows = {}
    for name, layout in LAYOUTS.items():
        res = run_distributed(
            bench, 2, timeout=900, layout=layout, steps=a.steps, warmup=a.warmup, spec=spec, cfg=cfg
        )
        rows[name] = {
            "tokens_per_s": res[0]["tokens_per_s"],
            "peak_rss_mib": [r["peak_rss_mib"] for r in res],
        }
    base = rows["DP2"]["tokens_per_s"]
    print(
        f"tiny GPT: {a.num_layers} layers, hidden {a.hidden_size}, seq {a.seq_length}, "
        f"global batch {a.global_batch_size}, fp32, 2 CPU processes x 1 thread"
    )
    print(f"{'layout':<13} {'tokens/s':>10} {'vs DP2':>7}   peak RSS per rank (MiB)")
    for name, r in rows.items():
        rss = " / ".join(f"{x:.0f}" for x in r["peak_rss_mib"])
        print(f"{name:<13} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / base:>6.2f}x   {rss}")


if __name__ == "__main__":
    main()
