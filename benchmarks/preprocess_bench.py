"""Throughput and peak RSS of ``anyspeed preprocess`` (1 vs 2 workers) vs a naive loop.

Run: ``python benchmarks/preprocess_bench.py [--mb 24] [--workers 2]``. Everything is generated
locally (corpus and a byte-level BPE tokenizer); each variant runs in its own process. With
``ANYSPEED_MEGATRON_LM`` pointing at a Megatron-LM checkout, Megatron's own
``tools/preprocess_data.py`` runs too (behind the one anyspeed line); its processing time is its
wall time minus the wall time of the same command on a one-document input.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil

MLM_RUNNER = (
    "import runpy, sys, torch\n"
    "import anyspeed.megatron_adaptor\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)

NAIVE = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    eod = tok.eos_token_id
    start = time.perf_counter()
    with open(sys.argv[2], encoding="utf-8") as src, open(sys.argv[3], "wb") as out:
        for line in src:
            ids = tok(json.loads(line)["text"])["input_ids"] + [eod]
            out.write(np.asarray(ids, dtype=np.uint16).tobytes())
    print(time.perf_counter() - start, file=sys.stderr)
    """
)


def make_corpus(path: str, megabytes: float, seed: int = 0) -> tuple[int, int]:
    """Write a jsonl corpus of roughly ``megabytes`` MB; returns (documents, bytes)."""
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
        for _ in range(5000)
    ]
    vocab += ["café", "naïve", "日本語", "данные", "1234", "3.14", "(x)", "--", "\n"]
    weights = [1 / (i + 1) for i in range(len(vocab))]  # Zipf-like, like natural text
    docs = 0
    with open(path, "w", encoding="utf-8") as fh:
        while fh.tell() < megabytes * 1e6:
            words = rng.choices(vocab, weights, k=rng.randint(20, 600))
            fh.write(json.dumps({"text": " ".join(words)}, ensure_ascii=False) + "\n")
            docs += 1
    return docs, os.path.getsize(path)


def _pss(p: psutil.Process) -> int:
    """Proportional set size (shared pages split between sharers), or RSS where unavailable."""
    try:
        return p.memory_full_info().pss
    except (AttributeError, psutil.AccessDenied):
        return p.memory_info().rss


def measure(cmd: list[str], env: dict) -> tuple[float, int, str]:
    """Wall seconds, peak memory (PSS summed over the process tree) and stderr of a command."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, _pss(ps) + sum(_pss(c) for c in ps.children(recursive=True)))
        except psutil.Error:
            pass
        time.sleep(0.05)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode()  # type: ignore[union-attr]
    if proc.returncode:
        raise SystemExit(f"{cmd[:4]} failed:\n{err}")
    return wall, peak, err


def main() -> None:
    """Generate data, run every variant, print a side-by-side table and ratios."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=24.0, help="corpus size in MB")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args()
    py = sys.executable
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="anyspeed-bench-") as d:
        corpus = os.path.join(d, "corpus.jsonl")
        docs, size = make_corpus(corpus, args.mb)
        sample = os.path.join(d, "sample.jsonl")
        with open(corpus, encoding="utf-8") as src, open(sample, "w", encoding="utf-8") as dst:
            for _, line in zip(range(2000), src, strict=False):
                dst.write(line)
        tok = os.path.join(d, "tok")
        subprocess.run(
            [py, "-m", "anyspeed.cli", "train-tokenizer", "--input", sample,
             "--vocab-size", str(args.vocab_size), "--output-dir", tok],
            check=True, env=env, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        print(f"corpus: {docs} documents, {size / 1e6:.1f} MB; tokenizer vocab {args.vocab_size}")
        runs: dict[str, tuple[float, int, float, str]] = {}
        naive_bin = os.path.join(d, "naive.bin")
        wall, peak, err = measure([py, "-c", NAIVE, tok, corpus, naive_bin], env)
        runs["naive (HF, 1 doc/call)"] = (wall, peak, float(err.strip() or "nan"), naive_bin)
        for w in sorted({1, args.workers}):
            prefix = os.path.join(d, f"w{w}")
            cmd = [py, "-m", "anyspeed.cli", "preprocess", "--input", corpus,
                   "--output-prefix", prefix, "--tokenizer-name-or-path", tok,
                   "--append-eod", "--workers", str(w)]  # fmt: skip
            wall, peak, err = measure(cmd, env)
            steady = float(re.search(r"documents read.* in ([0-9.]+)s", err).group(1))  # type: ignore[union-attr]
            runs[f"anyspeed --workers {w}"] = (wall, peak, steady, prefix + "_text_document.bin")
        mlm = os.environ.get("ANYSPEED_MEGATRON_LM")
        if mlm:
            one = os.path.join(d, "one.jsonl")
            with open(corpus, encoding="utf-8") as src, open(one, "w", encoding="utf-8") as dst:
                dst.write(src.readline())
            menv = {**env, "PYTHONPATH": mlm}
            for w in sorted({1, args.workers}):

                def mlm_cmd(inp: str, out: str, w: int = w) -> list[str]:
                    return [py, "-c", MLM_RUNNER, os.path.join(mlm, "tools", "preprocess_data.py"),
                            "--input", inp, "--output-prefix", out, "--tokenizer-type",
                            "HuggingFaceTokenizer", "--tokenizer-model", tok, "--append-eod",
                            "--workers", str(w), "--log-interval", "10000000"]  # fmt: skip

                start_up, _, _ = measure(mlm_cmd(one, os.path.join(d, f"m1_{w}")), menv)
                prefix = os.path.join(d, f"mlm{w}")
                wall, peak, _ = measure(mlm_cmd(corpus, prefix), menv)
                runs[f"Megatron-LM tool, {w} worker(s)"] = (
                    wall,
                    peak,
                    wall - start_up,
                    prefix + "_text_document.bin",
                )
        tokens = os.path.getsize(naive_bin) // 2
        same = {open(p, "rb").read() == open(naive_bin, "rb").read() for *_, p in runs.values()}
        print("rates use processing time (start-up: imports, tokenizer load, excluded);")
        print("wall s includes start-up; peak PSS sums the process tree (shared pages split)")
        head = f"{'variant':<26}{'wall s':>8}{'proc s':>8}{'docs/s':>9}{'tokens/s':>11}{'MB/s':>7}"
        print(head + f"{'peak PSS':>11}")
        for name, (wall, peak, busy, _) in runs.items():
            print(
                f"{name:<26}{wall:>8.2f}{busy:>8.2f}{docs / busy:>9.0f}{tokens / busy:>11.0f}"
                f"{size / 1e6 / busy:>7.2f}{peak / 2**20:>8.0f} MB"
            )
        base = runs["naive (HF, 1 doc/call)"][2]
        one = runs["anyspeed --workers 1"][2]
        many = runs[f"anyspeed --workers {args.workers}"][2]
        print(
            f"throughput ratios: --workers 1 / naive {base / one:.2f}x, "
            f"--workers {args.workers} / naive {base / many:.2f}x, "
            f"--workers {args.workers} / --workers 1 {one / many:.2f}x"
        )
        for w in sorted({1, args.workers}):
            key = f"Megatron-LM tool, {w} worker(s)"
            if key in runs:
                print(
                    f"--workers {w} vs Megatron-LM's tools/preprocess_data.py at {w}: "
                    f"{runs[key][2] / runs[f'anyspeed --workers {w}'][2]:.2f}x"
                )
        print(f"token streams identical across variants: {same == {True}}")


if __name__ == "__main__":
    main()
