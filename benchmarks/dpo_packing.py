"""DPO padded, with ``--variable-seq-lengths`` and with ``--use-remove-padding``, side by side
in one run (each run in its own process, the same pairs and seeds; the start and the reference
copy: a 3-step SFT checkpoint).

Pairs of random lengths (``--min-seq`` to ``--seq`` tokens, a quarter prompt) make the padding:
padded, each micro-batch is ``--seq`` tokens per sequence; with variable lengths, its longest
sequence; packed, its sequences end to end, no padding computed. The ratios compare the
median step time after the first and the process's peak memory.

    python benchmarks/dpo_packing.py [--hidden 512] [--layers 4] [--seq 512] [--min-seq 64]
        [--mbs 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch

from anyspeed.testing import run_distributed
from dpo import cli, make_sets, write
from sft import VOCAB, posttrain_run

RUNS = {
    "padded": [],
    "variable lengths": ["--variable-seq-lengths"],
    "remove padding": ["--use-remove-padding"],
}


def pairs(d: str, a: argparse.Namespace, n: int) -> str:
    """``n`` pairs whose sequences are ``--min-seq`` to ``--seq`` tokens, the first quarter of
    the shorter side a shared prompt (labels -100)."""
    rng = np.random.default_rng(0)
    cols: dict[str, list[np.ndarray]] = {f"{s}_{k}": [] for s in ("chosen", "rejected")
                                         for k in ("input_ids", "labels")}  # fmt: skip
    for _ in range(n):
        lengths = rng.integers(a.min_seq, a.seq + 1, 2)
        prompt = rng.integers(1, VOCAB - 1, int(lengths.min()) // 4)
        for side, length in zip(("chosen", "rejected"), lengths, strict=True):
            ids = np.concatenate([prompt, rng.integers(1, VOCAB - 1, length - len(prompt))])
            labels = ids.copy()
            labels[: len(prompt)] = -100
            cols[f"{side}_input_ids"].append(ids)
            cols[f"{side}_labels"].append(labels)
    write(os.path.join(d, "ragged"), cols)
    return os.path.join(d, "ragged")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--seq", 512), ("--min-seq", 64), ("--hidden", 512),
                          ("--layers", 4), ("--mbs", 4), ("--steps", 6)):  # fmt: skip
        p.add_argument(flag, type=int, default=default)
    a = p.parse_args()
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}, fp32, hidden {a.hidden}, "
          f"{a.layers} layers, sequences of {a.min_seq}-{a.seq} tokens, {a.mbs} pairs per "
          f"micro-batch, {a.steps} steps of 2 micro-batches")  # fmt: skip
    out = {}
    with tempfile.TemporaryDirectory() as d:
        data = pairs(d, a, 2 * a.mbs * a.steps)
        sft, ck = make_sets(d, a.seq, 16)[0], os.path.join(d, "ck")  # the start and reference
        run_distributed(posttrain_run, 1, argv=(x := cli(sft, "sft", a, 2, "--save", ck)), cli=x,
                        timeout=3600)  # fmt: skip
        for name, flags in RUNS.items():
            argv = cli(data, "dpo", a, a.mbs, "--optimization-level", "1", "--load", ck,
                       "--finetune", "--hidden-dropout", "0", "--attention-dropout", "0",
                       *flags)  # fmt: skip
            argv[argv.index("--train-iters") + 1] = str(a.steps)
            argv[argv.index("--global-batch-size") + 1] = str(2 * a.mbs)
            argv[argv.index("--log-interval") + 1] = str(a.steps)
            if os.environ.get("PROFILE"):
                argv += ["--profile", "--profile-step-start", "2", "--profile-step-end", "3",
                         "--tensorboard-dir", os.path.join(d, "tb")]  # fmt: skip
            res = run_distributed(posttrain_run, 1, argv=argv, cli=argv, timeout=3600)[0]
            out[name] = (float(np.median(np.diff(res["times"]))), res["peak"], res["loss"])
            print(f"  {name:16s} step {out[name][0]:6.2f} s | peak {out[name][1] / 2**20:7.1f} "
                  f"MiB | losses {[round(x, 6) for x in out[name][2]]}")  # fmt: skip
    pad = out["padded"]
    for name in list(RUNS)[1:]:
        print(f"  {name} / padded: {pad[0] / out[name][0]:.2f}x faster, "
              f"{out[name][1] / pad[1]:.3f}x the peak memory")  # fmt: skip


if __name__ == "__main__":
    main()
