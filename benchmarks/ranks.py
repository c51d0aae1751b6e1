"""Starting a set of test ranks: spawned against forked from the preloaded server
(``anyspeed.testing.forkserver``), side by side in one run.

Each round starts ``--world`` new ranks both ways (``run_distributed(..., fresh=True)``; a call
with an extra environment variable spawns), and every rank builds and trains a small Megatron
GPT for ``--steps`` steps. The table gives each way's wall time per start (the best and the
median of ``--rounds``, after one round that starts the fork server), each rank's CPU time from
its start (its imports included) and its time to train, so a forked rank's work is seen to run
as fast as a spawned one's.

    python benchmarks/ranks.py [--world 2] [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from anyspeed.testing import run_distributed


def rank_work(steps: int) -> tuple[str, float, float]:
    """The start method, this rank's CPU seconds from its start to the end of its work (its
    imports included), and its seconds to train."""
    import multiprocessing
    import resource

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    t1 = time.perf_counter()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=4, use_cpu_initialization=True
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=512, max_sequence_length=64)
    tokens = torch.randint(0, 512, (2, 64))
    pos = torch.arange(64).expand(2, 64)
    for _ in range(steps):
        model(tokens, pos, None, labels=tokens).sum().backward()
    took = time.perf_counter() - t1
    use = resource.getrusage(resource.RUSAGE_SELF)
    return multiprocessing.get_start_method(), use.ru_utime + use.ru_stime, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ranks import this module
    import ranks

    ways = {"spawned": {"ANYSPEED_BENCH_SPAWN": "1"}, "forked": {}}
    took: dict[str, list[float]] = {w: [] for w in ways}
    inner: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}  # (CPU, train)
    methods: dict[str, str] = {}
    for rnd in range(args.rounds + 1):
        for way, env in ways.items():
            t = time.perf_counter()
            out = run_distributed(
                ranks.rank_work, args.world, fresh=True, env=env, steps=args.steps
            )
            if rnd:  # round 0 starts the fork server
                took[way].append(time.perf_counter() - t)
                inner[way] += [(cpu, work) for _, cpu, work in out]
            methods[way] = out[0][0]
    print("| ranks | start method | start + work, best / median | CPU per rank | train |")
    print("| --- | --- | ---: | ---: | ---: |")
    for way in ways:
        cpu = statistics.median(c for c, _ in inner[way])
        work = statistics.median(w for _, w in inner[way])
        best, med = min(took[way]), statistics.median(took[way])
        print(f"| {way} | {methods[way]} | {best:.2f} / {med:.2f} s | {cpu:.2f} s | {work:.2f} s |")


if __name__ == "__main__":
    main()
