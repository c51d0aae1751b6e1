"""DualPipeV against Megatron's 1F1B and interleaved (VPP 2) schedules, side by side.

Two processes (one thread each) train the same model at PP2 under each schedule in turn, in one
process group, on the same synthetic batches (fp32, micro-batch 1, ``--microbatches`` per
step), and print the median time per step after the first, each schedule's ratio to 1F1B, the
loss of the first step (the three schedules start from differently placed random weights, so
they differ; their parity is in tests/training/test_dualpipev.py), the share of the step each
rank's DualPipeV receives spent waiting (its measured bubble) and, from the plans alone, the
pipeline bubble and the activations each rank holds at its peak, in whole micro-batches of the
rank's layers.

    python benchmarks/dualpipev.py [--layers 8] [--seq 256] [--vocab 32000] [--microbatches 4 8]
        [--steps 4] [--balanced]
"""

from __future__ import annotations

import argparse
import statistics
import time

from anyspeed.testing import run_distributed

SCHEDULES = {
    "1f1b": dict(pp=2),
    "interleaved (VPP 2)": dict(pp=2, vpp=2),
    "dualpipev": dict(pp=2, dualpipev=True),
    "dualpipev dw-detach": dict(pp=2, dualpipev=True, dualpipev_dw_detach=True),
}
# --balanced: fewer layers beside a heavy output layer (the last stage of 1F1B; the V's first
# and last stages, both on rank 0), for the same 8 layers
BALANCED = {
    "1f1b, stages 7/1": dict(pp=2, first_stage_layers=7, last_stage_layers=1),
    "dualpipev dw, 1/3/3/1": dict(pp=2, dualpipev=True, dualpipev_dw_detach=True,
                                  first_stage_layers=1, last_stage_layers=1),
}  # fmt: skip


def rank(
    layers: int, seq: int, vocab: int, microbatches: list[int], steps: int, schedules: dict
) -> dict:
    """Each schedule's step times (seconds) per micro-batch count, and its first loss."""
    import torch

    from anyspeed import quiet
    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig
    from anyspeed.stages.pretrain.task import PretrainTask
    from anyspeed.training import synthetic
    from anyspeed.training.config import TrainConfig
    from anyspeed.training.step import Trainer

    torch.set_num_threads(1)
    quiet.install()
    waited = _time_receives()
    model = ModelConfig(family="qwen2", num_layers=layers, hidden_size=512, ffn_hidden_size=1408,
                        num_attention_heads=8, num_query_groups=2, vocab_size=vocab,
                        add_qkv_bias=True)  # fmt: skip
    out: dict = {}
    for m in microbatches:
        for name, layout in schedules.items():
            cfg = TrainConfig(seq_length=seq, micro_batch_size=1, global_batch_size=m, lr=1e-4)
            t = Trainer(model, Layout(**layout), cfg, PretrainTask())
            times, waits, first = [], [], None
            for _ in range(steps):
                batch = synthetic.microbatches(model.vocab_size, cfg, t.iteration)
                torch.distributed.barrier()
                waited[0], start = 0.0, time.perf_counter()
                result = t.step(batch)
                times.append(time.perf_counter() - start)
                waits.append(waited[0])
                first = result["loss"] if first is None else first
            out[(m, name)] = (statistics.median(times[1:]), first, statistics.median(waits[1:]))
            del t
    return out


def _time_receives() -> list[float]:
    """Seconds DualPipeV's receives wait (this rank's idle time in the V), summed into the
    returned one-element list."""
    from anyspeed.distributed.dualpipev import schedule

    waited = [0.0]
    recv = schedule._Mail.recv

    def timed(self, link, grad):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        try:
            return recv(self, link, grad)
        finally:
            waited[0] += time.perf_counter() - start

    schedule._Mail.recv = timed
    return waited


def plan_figures(pp: int, m: int) -> tuple[float, float, float, float]:
    """(DualPipeV bubble, with dw-detach, 1F1B bubble, DualPipeV peak activations) from the
    plans, a chunk's backward costing two forwards (half of it the weight gradients); the
    peak in micro-batches of a rank's layers (1F1B: PP)."""
    from anyspeed.distributed.dualpipev import plan

    out = []
    for split in (False, True):
        t = plan.simulate([plan.training_plan(pp, r, m, split) for r in range(pp)])
        out.append(t.length / t.busy[0] - 1)
    return out[0], out[1], (pp - 1) / m, max(t.peak_alive) / 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--balanced", action="store_true",
                   help="also 1F1B and DualPipeV with fewer layers beside the output layer "
                   "(8 layers)")  # fmt: skip
    a = p.parse_args()
    schedules = {**SCHEDULES, **(BALANCED if a.balanced else {})}
    ranks = run_distributed(rank, 2, layers=a.layers, seq=a.seq, vocab=a.vocab,
                            microbatches=a.microbatches, steps=a.steps, schedules=schedules,
                            timeout=3600)  # fmt: skip
    got = ranks[0]
    print(f"PP2 x 1 thread each, {a.layers} layers, hidden 512, vocab {a.vocab}, seq {a.seq}, "
          "fp32")  # fmt: skip
    print(f"{'micro-batches':>13} | {'schedule':<22} | {'ms/step':>8} | {'vs 1F1B':>7} | "
          f"{'loss 1':>7} | waiting on a neighbour, rank 0 / 1")  # fmt: skip
    for m in a.microbatches:
        base = got[(m, "1f1b")][0]
        for name in schedules:
            sec, loss, _ = got[(m, name)]
            waits = " / ".join(f"{r[(m, name)][2] / sec:.1%}" for r in ranks)
            waits = waits if "dualpipev" in name else "-"
            print(f"{m:>13} | {name:<22} | {sec * 1e3:>8.0f} | {base / sec:>6.2f}x | "
                  f"{loss:>7.4f} | {waits}")  # fmt: skip
        bubble, detached, bubble_1f1b, peak = plan_figures(2, m)
        print(f"{'':>13}   plans: bubble DualPipeV {bubble:.1%} ({detached:.1%} with "
              f"dw-detach) vs 1F1B {bubble_1f1b:.1%}; peak activations {peak:g} vs 2 "
              "micro-batches")  # fmt: skip


if __name__ == "__main__":
    main()
