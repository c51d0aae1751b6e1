"""``anyspeed fsdp2`` (transformers' Qwen2 under FSDP2) vs ``anyspeed pretrain`` (Megatron-Core,
DP2 with the distributed optimizer) on the same model, side by side in one run.

Model: Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV groups, FFN 4864, vocab
151,936, tied embeddings), random weights, fp32, sequence 1024, micro batch 1 per rank, 2 CPU
processes, AdamW. Prints tokens/s and peak memory per rank (RSS high-water mark) of each,
averaged over the measured iterations after the warm-up ones.

    python benchmarks/fsdp2.py [--iters 2] [--warmup 1] [--seq 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_dropout": 0.0,
}  # fmt: skip


def _corpus(prefix: str, tokens: int) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    doc = rng.integers(0, CONFIG["vocab_size"], tokens)
    builder.add_document(torch.from_numpy(doc.astype(np.int64)), [tokens])
    builder.finalize(prefix + ".idx")


def _rows(metrics: str, warmup: int) -> dict:
    rows = [json.loads(line) for line in open(metrics)][warmup:]
    s = sum(r["ms_per_iter"] for r in rows) / len(rows) / 1000
    return {"s_per_iter": s, "peak_gib": max(r["peak_mem_gib"] for r in rows)}


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])


def run_fsdp2(d: str, iters: int, warmup: int, seq: int) -> dict:
    import yaml

    model = os.path.join(d, "model")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    _corpus(os.path.join(d, "corpus"), 2 * (iters + warmup + 1) * (seq + 1))
    metrics = os.path.join(d, "fsdp2.jsonl")
    cfg = {
        "model": {"model_name_or_path": model, "train_from_scratch": True},
        "data": {"dataset": os.path.join(d, "corpus"), "cutoff_len": seq},
        "training": {"per_device_train_batch_size": 1, "lr": 1e-4, "max_steps": iters + warmup,
                     "save_hf_weights": False, "metrics_file": metrics,
                     "no_progress_bar": True},
    }  # fmt: skip
    path = os.path.join(d, "fsdp2.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    _run([sys.executable, "-m", "anyspeed.cli", "fsdp2", path, "--nproc-per-node", "2"])
    return _rows(metrics, warmup)


def run_megatron(d: str, iters: int, warmup: int, seq: int) -> dict:
    metrics = os.path.join(d, "megatron.jsonl")
    _run([
        sys.executable, "-m", "anyspeed.cli", "pretrain", "--nproc-per-node", "2",
        "--model", "qwen2.5-0.5b", "--seq-length", str(seq), "--max-position-embeddings",
        str(seq), "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", str(iters + warmup), "--lr", "1e-4", "--mock-data",
        "--use-distributed-optimizer", "--eval-iters", "0", "--log-interval", "1",
        "--no-progress-bar", "--metrics-file", metrics,
    ])  # fmt: skip
    return _rows(metrics, warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args()
    from anyspeed import quiet

    quiet.install()  # Megatron's notices when the corpus writer is imported
    print(f"Qwen2.5-0.5B shape, fp32, seq {args.seq}, micro batch 1 x 2 CPU processes, "
          f"{args.iters} measured iterations after {args.warmup} warm-up", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        rows = [
            ("anyspeed pretrain (Megatron, DP2 + dist. optimizer)",
             run_megatron(d, args.iters, args.warmup, args.seq)),
            ("anyspeed fsdp2 (transformers + FSDP2)",
             run_fsdp2(d, args.iters, args.warmup, args.seq)),
        ]  # fmt: skip
    ref = rows[0][1]
    print(f"{'run':<52} {'tokens/s':>9} {'vs Megatron':>11} {'peak mem/rank':>14}")
    for name, r in rows:
        tps = 2 * args.seq / r["s_per_iter"]
        speed = ref["s_per_iter"] / r["s_per_iter"]
        print(f"{name:<52} {tps:>9,.0f} {speed:>10.2f}x {r['peak_gib']:>10.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
