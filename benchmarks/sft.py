"""SFT benchmarks, side by side in one run (each run in its own spawned process).

Part 1: packed vs padded SFT on an instruction set with a wide length spread (samples of
16..SEQ tokens, the first half of each a -100 prompt): non-padding tokens per second of
``anyspeed posttrain`` on the same samples, padded to ``--seq-length`` one per row, or
neat-packed several per row (``thd``, attention per sample).
Part 2: peak memory of full SFT vs LoRA (r 16 on linear_qkv/proj/fc1/fc2) on a larger model.
Part 3: the same on a MoE model (8 experts, top-2, grouped GEMM), LoRA on attention only and on
attention and every expert (MindSpeed-LLM's Qwen3-30B-A3B recipe): trainable parameters, peak
memory and seconds per step.

    python benchmarks/sft.py [--seq 512] [--samples 512] [--iters 8] [--hidden 256] [--part 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch

from anyspeed.testing import run_distributed

VOCAB = 1024


def write_columns(prefix: str, rows: list[dict]) -> None:
    """The three ``<prefix>_packed_*_document`` files preprocess writes, from ``rows``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    for kind in ("input_ids", "attention_mask", "labels"):
        path = f"{prefix}_packed_{kind}_document"
        builder = IndexedDatasetBuilder(path + ".bin", dtype=np.int32)
        for r in rows:
            builder.add_document(torch.from_numpy(np.asarray(r[kind], np.int64)), [len(r[kind])])
        builder.finalize(path + ".idx")


def make_sets(d: str, seq: int, n: int) -> tuple[str, str, int]:
    """An unpacked and a neat-packed copy of ``n`` samples; their non-padding token count."""
    from anyspeed.data.packing import Packer

    rng = np.random.default_rng(0)
    samples = []
    for _ in range(n):
        length = int(rng.integers(16, seq + 1))
        ids = rng.integers(1, VOCAB - 1, length)
        labels = ids.copy()
        labels[: length // 2] = -100
        samples.append({"input_ids": ids, "labels": labels, "attention_mask": np.ones(length)})
    write_columns(os.path.join(d, "pad"), samples)
    packer = Packer(seq, window=n, pad_id=0, neat=True)
    write_columns(os.path.join(d, "pack"), packer.add(samples) + packer.flush())
    return (
        os.path.join(d, "pad"),
        os.path.join(d, "pack"),
        sum(len(s["input_ids"]) for s in samples),
    )


def posttrain_run(cli: list[str]) -> dict:
    """One ``anyspeed posttrain`` run in this rank: step times after the first, peak memory."""
    from anyspeed import quiet
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train
    from anyspeed.training.loop import Hook

    class Clock(Hook):
        def __init__(self) -> None:
            self.times: list[float] = []

        def after_step(self, state, out) -> None:
            self.times.append(time.perf_counter())

    quiet.install()  # this rank's third-party notices, as the command hides them
    args, _ = prepare(cli, command="posttrain")
    clock = Clock()
    hist = train(args, task_for(args), extra_hooks=[clock])
    trainer = hist.pop("trainer")
    trainable = sum(p.numel() for m in trainer.model for p in m.parameters() if p.requires_grad)
    return {
        "times": clock.times,
        "peak": hist["peak_memory_bytes"],
        "trainable": trainable,
        "loss": hist["loss"],
    }


def base_cli(
    prefix: str, seq: int, iters: int, gbs: int, mbs: int, hidden: int, layers: int
) -> list[str]:
    return [
        "--stage",
        "sft",
        "--is-instruction-dataset",
        "--data-path",
        prefix,
        "--model",
        "tiny-qwen2.5",
        "--num-layers",
        str(layers),
        "--hidden-size",
        str(hidden),
        "--ffn-hidden-size",
        str(hidden * 11 // 4),
        "--num-attention-heads",
        "8",
        "--num-query-groups",
        "2",
        "--padded-vocab-size",
        str(VOCAB),
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--micro-batch-size",
        str(mbs),
        "--global-batch-size",
        str(gbs),
        "--train-iters",
        str(iters),
        "--lr",
        "1e-4",
        "--split",
        "100,0,0",
        "--eval-iters",
        "0",
        "--log-interval",
        str(iters),
        "--no-progress-bar",
    ]


def run(cli: list[str]) -> dict:
    return run_distributed(posttrain_run, 1, argv=cli, cli=cli, timeout=1800)[0]


REMOVE = ["--use-remove-padding", "--optimization-level", "1"]  # unpacked data packed at run time


def packed_vs_padded(a: argparse.Namespace, d: str) -> None:
    pad, pack, real = make_sets(d, a.seq, a.samples)
    rows = {"padded": (pad, []), "packed": (pack, []), "remove padding": (pad, REMOVE)}
    print(
        f"Part 1: {a.samples} samples of 16..{a.seq} tokens ({real} non-padding tokens), "
        f"{a.iters} steps of 8 rows, tokens/s after the first step"
    )
    rates = {}
    for name, (prefix, extra) in rows.items():
        from anyspeed.stages.common.instruction_data import open_data, sample_order

        data = open_data(prefix, a.seq)
        order = sample_order((0, len(data)), 8 * a.iters, 1234)[8:]
        tokens = sum(int((np.asarray(data.segments[int(i)]) != 0).sum()) for i in order)
        out = run(base_cli(prefix, a.seq, a.iters, 8, 2, a.hidden, 2) + extra)
        secs = out["times"][-1] - out["times"][0]
        rates[name] = tokens / secs
        print(f"  {name:14s} rows {len(data):5d} | non-padding tokens/s {rates[name]:9,.0f}")
    print(f"  packed / padded: {rates['packed'] / rates['padded']:.2f}x; remove padding / "
          f"padded: {rates['remove padding'] / rates['padded']:.2f}x")  # fmt: skip


def lora_vs_full(a: argparse.Namespace, d: str) -> None:
    os.makedirs(os.path.join(d, "mem"))
    pad, _, _ = make_sets(os.path.join(d, "mem"), a.seq, 64)
    print(f"Part 2: peak memory, hidden {a.hidden * 4}, 4 layers, seq {a.seq}, 3 steps")
    peaks = {}
    lora = [
        "--lora-r",
        "16",
        "--lora-alpha",
        "32",
        "--lora-target-modules",
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
    ]
    for name, extra in (("full", []), ("lora", lora)):
        out = run(base_cli(pad, a.seq, 3, 4, 2, a.hidden * 4, 4) + extra)
        peaks[name] = out["peak"]
        print(
            f"  {name:4s} trainable {out['trainable']:11,d} | peak {out['peak'] / 2**20:8.1f} MiB"
        )
    print(f"  lora / full peak memory: {peaks['lora'] / peaks['full']:.2f}x")


MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-grouped-gemm",
       "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.001"]  # fmt: skip


def lora_on_experts(a: argparse.Namespace, d: str) -> None:
    os.makedirs(os.path.join(d, "moe"))
    pad, _, _ = make_sets(os.path.join(d, "moe"), a.seq, 64)
    hidden = a.hidden * 4
    moe = [*MOE, "--moe-ffn-hidden-size", str(hidden // 2)]
    print(f"Part 3: MoE, hidden {hidden}, 4 layers, 8 experts top-2, seq {a.seq}, 4 steps")
    lora = ["--lora-r", "16", "--lora-alpha", "32", "--lora-target-modules"]
    rows = {
        "full": [],
        "lora attention": [*lora, "linear_qkv", "linear_proj"],
        "lora + experts": [*lora, "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
    }
    peaks = {}
    for name, extra in rows.items():
        out = run(base_cli(pad, a.seq, 4, 4, 2, hidden, 4) + moe + extra)
        peaks[name] = out["peak"]
        step = (out["times"][-1] - out["times"][0]) / (len(out["times"]) - 1)
        print(f"  {name:14s} trainable {out['trainable']:11,d} | peak "
              f"{out['peak'] / 2**20:8.1f} MiB | {step:6.2f} s/step")  # fmt: skip
    print(f"  lora + experts / full peak memory: {peaks['lora + experts'] / peaks['full']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--part", type=int, choices=(1, 2, 3), default=None, help="one part only")
    a = p.parse_args()
    parts = {1: packed_vs_padded, 2: lora_vs_full, 3: lora_on_experts}
    with tempfile.TemporaryDirectory() as d:
        for k, part in parts.items():
            if a.part in (None, k):
                part(a, d)


if __name__ == "__main__":
    main()
