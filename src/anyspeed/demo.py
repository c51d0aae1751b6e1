"""``anyspeed demo``: the whole LLM workflow offline, on files every machine has.

1. corpus: the Python standard library's own source files, as jsonl;
2. ``anyspeed train-tokenizer``: a byte-level BPE tokenizer (a standard HF directory);
3. ``anyspeed preprocess``: Megatron ``.bin/.idx``;
4. ``anyspeed pretrain``: a small Qwen2.5-architecture model on N CPU processes (TP=N, sequence
   parallel), with validation, a checkpoint and a generated sample.

It fails (exit 1) unless the loss has clearly fallen. Extra flags go to ``anyspeed pretrain``
and win over the demo's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
import time
from collections.abc import Sequence

# Qwen2.5's architecture (GQA, QKV bias, RMSNorm, SwiGLU, RoPE, tied embeddings) at CPU size.
DEMO_MODEL = [
    "--model", "tiny-qwen2.5", "--num-layers", "4", "--hidden-size", "128",
    "--ffn-hidden-size", "352", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--micro-batch-size", "8", "--global-batch-size", "16",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "20", "--weight-decay", "0.1", "--adam-beta2", "0.95",
    "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--split", "98,1,1", "--eval-interval", "100", "--eval-iters", "4", "--log-interval", "25",
]  # fmt: skip
# With --moe: Qwen3-MoE's architecture (QK norm, 8 experts, top-2, aux loss) at CPU size,
# experts spread over the processes (expert parallel) with the all-to-all dispatcher.
DEMO_MOE = [
    "--moe-ffn-hidden-size", "128", "--moe-aux-loss-coeff", "0.01",
    "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
]  # fmt: skip
VOCAB = 1024
PROMPT = "def read_file(path):\n    "


def build_corpus(path: str, max_bytes: int) -> tuple[int, int]:
    """Write stdlib ``.py`` files (sorted, so every machine builds the same order) as jsonl."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    files += sorted(glob.glob(os.path.join(stdlib, "*", "*.py")))
    n = size = 0
    with open(path, "w", encoding="utf-8") as out:
        for f in files:
            if "site-packages" in f or "test" in os.path.basename(os.path.dirname(f)):
                continue
            try:
                text = open(f, encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            if len(text) < 200:
                continue
            out.write(json.dumps({"text": text}) + "\n")
            n += 1
            size += len(text.encode())
            if size >= max_bytes:
                break
    return n, size


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="anyspeed demo", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="anyspeed-demo", help="where data and checkpoints go")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--train-iters", type=int, default=400)
    p.add_argument("--corpus-mb", type=float, default=6.0)
    p.add_argument("--moe", action="store_true",
                   help="a Qwen3-MoE-style model, experts over the processes (EP=N)")  # fmt: skip
    args, extra = p.parse_known_args(argv)
    from anyspeed.data.cli import main as data_main
    from anyspeed.training.pretrain import main as pretrain_main

    t0 = time.perf_counter()
    os.makedirs(args.workdir, exist_ok=True)
    corpus = os.path.join(args.workdir, "stdlib.jsonl")
    docs, size = build_corpus(corpus, int(args.corpus_mb * 2**20))
    print(f"[1/4] corpus: {docs} Python standard-library files, {size / 2**20:.1f} MB -> {corpus}")
    tok_dir = os.path.join(args.workdir, "tokenizer")
    rc = data_main(["train-tokenizer", "--input", corpus, "--vocab-size", str(VOCAB),
                    "--output-dir", tok_dir, "--overwrite"])  # fmt: skip
    if rc:
        return rc
    print(f"[2/4] tokenizer: byte-level BPE, {VOCAB} tokens -> {tok_dir}")
    prefix = os.path.join(args.workdir, "stdlib")
    rc = data_main(["preprocess", "--input", corpus, "--output-prefix", prefix,
                    "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tok_dir,
                    "--append-eod", "--workers", "2", "--overwrite", "--quiet"])  # fmt: skip
    if rc:
        return rc
    data = prefix + "_text_document"
    print(f"[3/4] preprocess: {data}.bin/.idx")
    save = os.path.join(args.workdir, "checkpoints")
    metrics = os.path.join(args.workdir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    n = args.nproc_per_node
    model = list(DEMO_MODEL)
    layout = ["--tensor-model-parallel-size", str(n), *(["--sequence-parallel"] if n > 1 else [])]
    if args.moe:
        model[model.index("tiny-qwen2.5")] = "tiny-qwen3-moe"
        layout = ["--expert-model-parallel-size", str(n), *DEMO_MOE]
    cmd = [
        "--nproc-per-node", str(n), *model, *layout, "--padded-vocab-size", str(VOCAB),
        "--train-iters", str(args.train_iters),
        "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tok_dir,
        "--data-path", data, "--save", save, "--save-interval", str(args.train_iters),
        "--generate-prompt", PROMPT, "--generate-tokens", "48", "--metrics-file", metrics,
        *extra,
    ]  # fmt: skip
    print(f"[4/4] anyspeed pretrain {' '.join(cmd)}", flush=True)
    rc = pretrain_main(cmd)
    if rc == 0:
        rows = [json.loads(line) for line in open(metrics)]
        first, last = rows[0]["lm_loss"], rows[-1]["lm_loss"]
        fell = last < 0.75 * first
        print(f"demo: lm loss {first:.3f} (iteration {rows[0]['iteration']}) -> {last:.3f} "
              f"(iteration {rows[-1]['iteration']}): "
              + ("clearly falling, OK" if fell else "NOT clearly falling"))  # fmt: skip
        if args.moe:
            load = max(r["expert_load_max_over_mean"] for r in rows)
            print(f"demo: expert load max/mean at most {load:.2f} over the logged iterations")
        rc = 0 if fell else 1
    print(f"demo finished in {time.perf_counter() - t0:.0f} s (exit {rc}); checkpoint in {save}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
