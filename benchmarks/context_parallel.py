"""Context parallelism at long sequence: memory per rank, tokens/s and bytes sent, per algorithm.

A tiny GPT (2 layers, hidden 512, 8 heads, vocab 256) trains at sequence 16k (default) on CP
CPU processes (CP = world, so one sequence is split across all ranks) for CP=1, 2, 4 with ring
(``megatron_cp_algo``), Ulysses (``ulysses_cp_algo``) and hybrid 2x2 (``hybrid_cp_algo``). Per
run it prints tokens/s; per rank, the activations autograd saves for the backward pass and the
first step's peak-RSS growth; and the bytes each rank sends per step for attention (ring p2p +
all-to-all) and for gradient reduction. From the activation memory per token it derives the
longest sequence whose activations fit a fixed per-rank budget (flash attention makes
activation memory linear in the sequence length).

    python benchmarks/context_parallel.py [--seq-length 16384] [--steps 2] [--budget-mib 1024]
"""

from __future__ import annotations

import argparse
import time

from anyspeed.testing import run_distributed

RUNS = [
    ("CP=1", 1, "p2p", None),
    ("CP=2 ring", 2, "p2p", None),
    ("CP=2 Ulysses", 2, "a2a", None),
    ("CP=4 ring", 4, "p2p", None),
    ("CP=4 Ulysses", 4, "a2a", None),
    ("CP=4 hybrid 2x2", 4, "a2a+p2p", 2),
]
FLAG = {"p2p": "megatron_cp_algo", "a2a": "ulysses_cp_algo", "a2a+p2p": "hybrid_cp_algo"}


def _count_bytes():
    """Wrap the collectives CP and DDP use; returns the live counters."""
    import torch.distributed as dist

    sent = {"attention": 0, "gradients": 0}

    def nbytes(t):
        return t.numel() * t.element_size()

    real_p2p, real_a2a, real_ar = dist.batch_isend_irecv, dist.all_to_all_single, dist.all_reduce
    real_rs = dist.reduce_scatter_tensor

    def p2p(ops):
        sent["attention"] += sum(nbytes(op.tensor) for op in ops if op.op is dist.isend)
        return real_p2p(ops)

    def a2a(output, input, *a, **kw):
        world = dist.get_world_size(kw.get("group"))
        sent["attention"] += nbytes(input) * (world - 1) // world  # all but the own slice
        return real_a2a(output, input, *a, **kw)

    def all_reduce(t, *a, **kw):
        world = dist.get_world_size(kw.get("group"))
        sent["gradients"] += 2 * nbytes(t) * (world - 1) // max(world, 1)  # ring all-reduce
        return real_ar(t, *a, **kw)

    def reduce_scatter(out, inp, *a, **kw):
        world = dist.get_world_size(kw.get("group"))
        sent["gradients"] += nbytes(inp) * (world - 1) // max(world, 1)
        return real_rs(out, inp, *a, **kw)

    dist.batch_isend_irecv, dist.all_to_all_single = p2p, a2a
    dist.all_reduce, dist.reduce_scatter_tensor = all_reduce, reduce_scatter
    return sent


def bench(cp: int, algo: str, degree: int | None, seq: int, steps: int) -> dict:
    import torch

    from anyspeed.device import cpu_cuda
    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig
    from anyspeed.stages.pretrain.task import PretrainTask
    from anyspeed.training.config import TrainConfig
    from anyspeed.training.step import Trainer
    from anyspeed.training.synthetic import train_step

    model = ModelConfig(num_layers=2, hidden_size=512, num_attention_heads=8, ffn_hidden_size=1408,
                        vocab_size=256)  # fmt: skip
    cfg = TrainConfig(seq_length=seq, micro_batch_size=1, global_batch_size=1)
    t = Trainer(model, Layout(cp=cp, cp_algo=algo, ulysses_degree=degree), cfg, PretrainTask())
    # Activation memory, counted exactly: the storage autograd keeps for the backward pass.
    saved: dict[int, int] = {}

    def pack(x):
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    base = cpu_cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        train_step(t)  # warm-up, also the step whose peak-RSS growth is reported
    rss_growth = max(cpu_cuda.max_memory_allocated() - base, 0)
    sent = _count_bytes()
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        train_step(t)
    torch.distributed.barrier()
    elapsed = time.perf_counter() - start
    return {
        "tokens_per_s": steps * seq / elapsed,
        "act_mib": sum(saved.values()) / 2**20,
        "rss_mib": rss_growth / 2**20,
        "attn_mib": sent["attention"] / steps / 2**20,
        "grad_mib": sent["gradients"] / steps / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=16384)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--budget-mib", type=float, default=1024.0)
    a = p.parse_args()
    print(f"tiny GPT (2 layers, hidden 512), sequence {a.seq_length}, {a.steps} steps, fp32, "
          "CP ranks as CPU processes; act = activations saved for backward per rank, RSS = "
          "first step's peak-RSS growth per rank")  # fmt: skip
    print(f"{'run':<16} {'tokens/s':>9} {'act MiB/rank':>13} {'vs CP=1':>8} {'RSS MiB':>8} "
          f"{'attn MiB sent/rank':>19} {'grad MiB sent/rank':>19} "
          f"{'max seq in budget':>18}")  # fmt: skip
    base = None
    for name, cp, algo, degree in RUNS:
        argv = [] if cp == 1 else ["--context-parallel-size", str(cp),
                                   "--context-parallel-algo", FLAG[algo]]  # fmt: skip
        if degree:
            argv += ["--ulysses-degree-in-cp", str(degree)]
        res = run_distributed(bench, cp, cp=cp, algo=algo, degree=degree, seq=a.seq_length,
                              steps=a.steps, argv=argv, timeout=3600)  # fmt: skip
        act = max(r["act_mib"] for r in res)
        base = base or act
        longest = a.budget_mib / (act / a.seq_length) if act else float("inf")
        rss = max(r["rss_mib"] for r in res)
        print(f"{name:<16} {res[0]['tokens_per_s']:>9,.0f} {act:>13,.0f} {act / base:>7.2f}x "
              f"{rss:>8,.0f} "
              f"{max(r['attn_mib'] for r in res):>19,.1f} "
              f"{max(r['grad_mib'] for r in res):>19,.1f} {longest:>18,.0f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
