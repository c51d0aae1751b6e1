"""DPO memory, side by side in one run (each run in its own spawned process).

Part 1: peak memory of DPO-LoRA vs SFT-LoRA of the same model (r 16 on linear_qkv/proj/fc1/
fc2) on the same number of sequences per micro-batch (SFT 2 samples, DPO 1 pair = 2
sequences): the reference is the base with adapters off, so DPO adds no second model.
Part 2: full DPO vs full SFT: the frozen reference copy adds its weights only (no gradients,
no optimizer state), against the policy's weights, gradients and Adam moments.

    python benchmarks/dpo.py [--seq 512] [--hidden 1024] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch

from anyspeed.testing import run_distributed
from sft import VOCAB, base_cli, posttrain_run

LORA = ["--lora-r", "16", "--lora-alpha", "32", "--lora-target-modules", "linear_qkv",
        "linear_proj", "linear_fc1", "linear_fc2"]  # fmt: skip


def write(prefix: str, columns: dict[str, list[np.ndarray]]) -> None:
    """``<prefix>_packed_<kind>_document`` files from per-row arrays."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    for kind, rows in columns.items():
        path = f"{prefix}_packed_{kind}_document"
        builder = IndexedDatasetBuilder(path + ".bin", dtype=np.int32)
        for r in rows:
            builder.add_document(torch.from_numpy(np.asarray(r, np.int64)), [len(r)])
        builder.finalize(path + ".idx")


def make_sets(d: str, seq: int, n: int) -> tuple[str, str]:
    """An instruction set and a pairwise set of ``seq``-token sequences (half prompt)."""
    rng = np.random.default_rng(0)

    def sample() -> tuple[np.ndarray, np.ndarray]:
        ids = rng.integers(1, VOCAB - 1, seq)
        labels = ids.copy()
        labels[: seq // 2] = -100
        return ids, labels

    sft = [sample() for _ in range(n)]
    write(os.path.join(d, "sft"), {"input_ids": [s[0] for s in sft], "labels": [s[1] for s in sft],
                                   "attention_mask": [np.ones(seq) for _ in sft]})  # fmt: skip
    cols: dict[str, list[np.ndarray]] = {}
    for side in ("chosen", "rejected"):
        rows = [sample() for _ in range(n)]
        cols[f"{side}_input_ids"] = [r[0] for r in rows]
        cols[f"{side}_labels"] = [r[1] for r in rows]
    write(os.path.join(d, "pairs"), cols)
    return os.path.join(d, "sft"), os.path.join(d, "pairs")


def cli(prefix: str, stage: str, a: argparse.Namespace, mbs: int, *extra: str) -> list[str]:
    argv = base_cli(prefix, a.seq, 3, 2, mbs, a.hidden, a.layers)
    if stage != "sft":
        i = argv.index("--is-instruction-dataset")
        argv[i] = "--is-pairwise-dataset"
        argv[argv.index("sft")] = stage
    return argv + list(extra)


def run(argv: list[str]) -> dict:
    return run_distributed(posttrain_run, 1, argv=argv, cli=argv, timeout=1800)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}, hidden {a.hidden}, "
          f"{a.layers} layers, seq {a.seq}, 3 steps, 2 sequences per micro-batch")  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        sft, pairs = make_sets(d, a.seq, 16)
        peaks = {}
        ck = os.path.join(d, "ck")
        cases = {
            "sft-lora": cli(sft, "sft", a, 2, *LORA),
            "dpo-lora": cli(pairs, "dpo", a, 1, *LORA),
            "sft-full": cli(sft, "sft", a, 2, "--save", ck, "--save-interval", "3"),
            "dpo-full": cli(pairs, "dpo", a, 1, "--load", ck, "--finetune"),
        }
        for name, argv in cases.items():
            out = run(argv)
            peaks[name] = out["peak"]
            print(f"  {name:8s} trainable {out['trainable']:11,d} | peak "
                  f"{out['peak'] / 2**20:8.1f} MiB")  # fmt: skip
        print(f"  dpo-lora / sft-lora peak memory: {peaks['dpo-lora'] / peaks['sft-lora']:.3f}x")
        extra = (peaks["dpo-full"] - peaks["sft-full"]) / 2**20
        params = out["trainable"]
        print(f"  dpo-full - sft-full: {extra:.1f} MiB; the reference's fp32 weights are "
              f"{params * 4 / 2**20:.1f} MiB, the policy's weights + grads + Adam "
              f"{params * 16 / 2**20:.1f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
