"""Muon against AdamW: steps to reach AdamW's loss, one 2-layer model, side by side in one run.

Data: the demos' corpus (Python standard-library sources, byte-level BPE of 1024 tokens, built
here, no download). Model: 2 layers, hidden 128, 4 heads, 2 KV groups, FFN 352, sequence 256,
global batch 16, constant lr after 10 warm-up iterations, fp32, 1 process. For each optimizer
the lr is the best of a small sweep; the loss is smoothed over 10 iterations. It prints the
iteration at which Muon's smoothed loss first reaches AdamW's final smoothed loss, and the ratio
(the issue asks for at most 0.9).

    python benchmarks/muon.py [--iters 200] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

ARCH = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "352",
        "--seq-length", "256", "--max-position-embeddings", "256", "--swiglu",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights"]  # fmt: skip
SWEEP = {"adam": ["3e-4", "1e-3", "3e-3", "1e-2"], "muon": ["1e-2", "3e-2"]}


def data(workdir: str) -> tuple[str, str]:
    """The demos' corpus and tokenizer, preprocessed: (tokenizer dir, data prefix)."""
    from anyspeed.commands.preprocess import main as data_main
    from anyspeed.demo.common import tokenizer_steps

    rc, tok = tokenizer_steps(workdir, 3.0, 3)
    prefix = os.path.join(workdir, "stdlib")
    rc = rc or data_main(["preprocess", "--input", os.path.join(workdir, "stdlib.jsonl"),
                          "--output-prefix", prefix, "--tokenizer-type", "PretrainedFromHF",
                          "--tokenizer-name-or-path", tok, "--append-eod", "--workers", "2",
                          "--overwrite", "--quiet"])  # fmt: skip
    if rc:
        raise SystemExit(rc)
    return tok, prefix + "_text_document"


def run(workdir: str, tok: str, prefix: str, optimizer: str, lr: str, iters: int) -> list[float]:
    """Smoothed training losses of one run."""
    from anyspeed.commands.train import pretrain

    metrics = os.path.join(workdir, f"{optimizer}-{lr}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    extra = ["--muon-extra-scale-factor", "0.2"] if optimizer == "muon" else []  # AdamW's RMS
    rc = pretrain([*ARCH, "--optimizer", optimizer, *extra, "--lr", lr, "--min-lr", lr,
                   "--lr-warmup-iters", "10", "--lr-decay-style", "constant",
                   "--micro-batch-size", "8", "--global-batch-size", "16",
                   "--train-iters", str(iters), "--weight-decay", "0.01", "--clip-grad", "1.0",
                   "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tok,
                   "--data-path", prefix, "--padded-vocab-size", "1024", "--eval-iters", "0",
                   "--log-interval", "1", "--metrics-file", metrics, "--seed", "1234"])  # fmt: skip
    if rc:
        raise SystemExit(rc)
    losses = [json.loads(line)["lm_loss"] for line in open(metrics)]
    return [sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1])
            for i in range(len(losses))]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--workdir", default=None)
    a = p.parse_args()
    workdir = a.workdir or tempfile.mkdtemp(prefix="anyspeed-muon-")
    tok, prefix = data(workdir)
    best: dict[str, tuple[float, str, list[float]]] = {}
    for optimizer, lrs in SWEEP.items():
        for lr in lrs:
            t0 = time.perf_counter()
            curve = run(workdir, tok, prefix, optimizer, lr, a.iters)
            print(f"{optimizer:5s} lr {lr:5s}: final smoothed loss {curve[-1]:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
            if optimizer not in best or curve[-1] < best[optimizer][0]:
                best[optimizer] = (curve[-1], lr, curve)
    target, adam_lr, _ = best["adam"]
    final, muon_lr, curve = best["muon"]
    reached = next((i + 1 for i, x in enumerate(curve) if x <= target), None)
    print(f"AdamW (lr {adam_lr}) after {a.iters} iterations: {target:.4f}; "
          f"Muon (lr {muon_lr}): {final:.4f}")  # fmt: skip
    if reached is None:
        print("Muon did not reach AdamW's final loss")
    else:
        print(f"Muon reaches it at iteration {reached}: {reached / a.iters:.2f}x AdamW's steps")


if __name__ == "__main__":
    main()
