"""Training speed on one device, side by side in one run: ``anyspeed pretrain`` at
``--optimization-level`` 0, 1 and 2 against Megatron-LM's own ``pretrain_gpt.py`` on the local
spec without anyspeed (when ``ANYSPEED_MEGATRON_LM`` points at a checkout).

Model: the ``qwen2.5-1.5b`` preset, bf16, sequence 4096, micro batch 1, mock data, the
distributed optimizer; 10 iterations, the last 5 timed (median). Each row prints tokens/s, the
time per iteration, MFU and the peak memory anyspeed reports. MFU is by Megatron's FLOPs formula
where Megatron's row ran: its TFLOP/s x time gives Megatron's FLOPs per iteration, the same for
every row. Otherwise it is anyspeed's own count. ``--dry`` runs the same rows on a tiny model
on the CPU, so the script cannot rot (a fast test runs it).

    python benchmarks/gpu.py [--dry] [--iters 10] [--levels 0 1 2]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"  # thousands separated by commas in anyspeed's line
LINE = re.compile(r"elapsed time per iteration \(ms\): " + NUM)
FIELDS = {
    "tokens": re.compile(r"tokens/s: " + NUM),
    "tflops": re.compile(r"TFLOP/s: " + NUM),
    "mfu": re.compile(r"MFU: " + NUM + "%"),
    "peak": re.compile(r"peak mem: " + NUM + " GiB"),
    "megatron_tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): " + NUM),
}


def _num(m: re.Match) -> float:
    return float(m.group(1).replace(",", ""))


def shape(dry: bool) -> list[str]:
    """The model and batch flags both programs take."""
    if dry:
        return ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
                "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups",
                "2", "--seq-length", "64", "--max-position-embeddings", "64",
                "--micro-batch-size", "2", "--global-batch-size", "2"]  # fmt: skip
    return ["--num-layers", "28", "--hidden-size", "1536", "--ffn-hidden-size", "8960",
            "--num-attention-heads", "12", "--group-query-attention", "--num-query-groups", "2",
            "--add-qkv-bias", "--seq-length", "4096", "--max-position-embeddings", "32768",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16"]  # fmt: skip


COMMON = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
          "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--lr", "1e-5",
          "--mock-data", "--log-interval", "1", "--eval-iters", "0", "--split", "100,0,0",
          "--use-distributed-optimizer", "--attention-dropout", "0", "--hidden-dropout", "0",
          "--seed", "7"]  # fmt: skip


def parse(text: str, skip: int) -> dict[str, float]:
    """Medians of each field over the iteration lines after the first ``skip``."""
    lines = [ln for ln in text.splitlines() if LINE.search(ln)][skip:]
    if not lines:
        raise RuntimeError("no iteration lines:\n" + text[-3000:])
    out = {"ms": statistics.median(_num(LINE.search(ln)) for ln in lines)}
    for key, pattern in FIELDS.items():
        vals = [_num(m) for ln in lines if (m := pattern.search(ln))]
        if vals:
            out[key] = statistics.median(vals)
    return out


def anyspeed_row(level: int, iters: int, dry: bool, vocab: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "anyspeed", "pretrain", *shape(dry), *COMMON, "--vocab-size",
           vocab, "--train-iters", str(iters), "--optimization-level", str(level),
           "--no-progress-bar"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if res.returncode:
        raise RuntimeError(f"level {level}: {res.stderr[-2000:]}")
    return parse(res.stdout + res.stderr, skip=iters // 2)


def megatron_row(iters: int, dry: bool, vocab: str) -> dict[str, float] | None:
    """Megatron-LM's pretrain_gpt.py on the local spec, no anyspeed (None without a checkout;
    the dry run needs a device it can run on, so it runs it only where CUDA is)."""
    import torch

    root = os.environ.get("ANYSPEED_MEGATRON_LM")
    if not root or not torch.cuda.is_available():
        return None
    tok = ["--tokenizer-type", "NullTokenizer", "--vocab-size", vocab]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "1", os.path.join(root, "pretrain_gpt.py"), *shape(dry),
               *COMMON, *tok, "--train-iters", str(iters), "--transformer-impl", "local",
               "--log-throughput", "--save", tmp, "--save-interval", "100000"]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=root, CUDA_DEVICE_MAX_CONNECTIONS="1")
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    if res.returncode:
        raise RuntimeError(f"pretrain_gpt.py: {res.stderr[-2000:]}")
    return parse(res.stdout + res.stderr, skip=iters // 2)


def table(rows: dict[str, dict[str, float] | None]) -> list[str]:
    """One line per row; MFU by Megatron's FLOPs where its row ran."""
    ref = rows.get("megatron local")
    flops = ref["megatron_tflops"] * ref["ms"] * 1e9 if ref and "megatron_tflops" in ref else None
    lines = []
    for name, r in rows.items():
        if r is None:
            lines.append(f"{name:16} skipped (set ANYSPEED_MEGATRON_LM; needs CUDA)")
            continue
        peak_tflops = r["tflops"] / (r["mfu"] / 100) if r.get("mfu") else None
        if flops and peak_tflops:
            mfu, how = flops / (r["ms"] * 1e9) / peak_tflops * 100, "Megatron's FLOPs"
        else:
            mfu, how = r.get("mfu", float("nan")), "anyspeed's FLOPs"
        tokens, peak = r.get("tokens", float("nan")), r.get("peak", float("nan"))
        lines.append(f"{name:16} {tokens:10.0f} tokens/s {r['ms']:9.1f} ms/iter "
                     f"MFU {mfu:5.1f}% ({how}) peak {peak:.2f} GiB")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="a tiny model on this machine's device")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args(argv)
    vocab = "512" if args.dry else "151936"
    rows: dict[str, dict[str, float] | None] = {}
    for level in args.levels:
        rows[f"anyspeed level {level}"] = anyspeed_row(level, args.iters, args.dry, vocab)
    rows["megatron local"] = megatron_row(args.iters, args.dry, vocab)
    lines = table(rows)
    print("\n".join(lines), flush=True)
    return lines


if __name__ == "__main__":
    main()
