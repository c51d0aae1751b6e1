"""Training speed on one device, side by side in one run: ``anyspeed pretrain`` at
``--optimization-level`` 0, 1 and 2 against Megatron-LM's own ``pretrain_gpt.py`` on the local
spec without anyspeed (when ``ANYSPEED_MEGATRON_LM`` points at a checkout).

Model: the ``qwen2.5-1.5b`` preset, bf16, sequence 4096, micro batch 1, mock data, the
distributed optimizer; 10 iterations, the last 5 timed (median). Each row prints tokens/s, the
time per iteration, MFU and the peak memory anyspeed reports. MFU is by Megatron's FLOPs formula
where Megatron's row ran: its TFLOP/s x time gives Megatron's FLOPs per iteration, the same for
every row. Otherwise it is anyspeed's own count. The rows of levels 0 and 2 also profile two
untimed steps (``--profile``) and print where a step's device time goes: the matrix products'
share and the top operators, side by side for plain Megatron-Core and anyspeed's default.
``--dry`` runs the same rows on a tiny model (bf16 too) on the CPU, so the script cannot rot (a
fast test runs it).

``--fp8-recipe tensorwise`` adds, after each level's row, the same level with
``--fp8-format hybrid`` (anyspeed's FP8 GEMMs: ``torch._scaled_mm`` on an FP8 GPU).

    python benchmarks/gpu.py [--dry] [--iters 10] [--levels 0 1 2] [--profile-levels 0 2]
        [--fp8-recipe tensorwise] [--no-megatron]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"  # thousands separated by commas in anyspeed's line
LINE = re.compile(r"elapsed time per iteration \(ms\): " + NUM)
FIELDS = {
    "tokens": re.compile(r"tokens/s: " + NUM),
    "tflops": re.compile(r"TFLOP/s: " + NUM),
    "mfu": re.compile(r"MFU: " + NUM + "%"),
    "peak": re.compile(r"peak mem: " + NUM + " GiB"),
    "megatron_tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): " + NUM),
}
PROFILE = re.compile(r"profile of steps .*")  # anyspeed's --profile line
WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_pretrain.py")


def _num(m: re.Match) -> float:
    return float(m.group(1).replace(",", ""))


def shape(dry: bool) -> list[str]:
    """The model and batch flags both programs take."""
    if dry:
        return ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
                "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups",
                "2", "--seq-length", "64", "--max-position-embeddings", "64",
                "--micro-batch-size", "2", "--global-batch-size", "2", "--bf16"]  # fmt: skip
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


def _run(name: str, cmd: list[str], timeout: int, skip: int, env: dict | None = None) -> dict:
    """One row's program; its medians (and its ``--profile`` line as ``profile``), or
    ``{"error": ...}`` (one line) when it failed or ran past ``timeout`` seconds, so the other
    rows still run and print."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past --row-timeout {timeout} s"}
    text = res.stdout + res.stderr
    if res.returncode:
        tail = [ln for ln in res.stderr.splitlines() if ln.strip()][-1:] or ["(no output)"]
        end = text[-3000:]
        print(
            f"{name}: exit {res.returncode}; its output's end:\n{end}", file=sys.stderr, flush=True
        )
        return {"error": f"exit {res.returncode}: {tail[0][:160]}"}
    try:
        out = parse(text, skip)
    except RuntimeError as e:
        return {"error": str(e).splitlines()[0]}
    found = PROFILE.search(text)
    return out if found is None else dict(out, profile=found.group(0))


def profile_window(iters: int) -> list[str]:
    """``--profile`` flags for the (up to) two steps before the timed ones (those after the
    first ``iters // 2``), so the profiler's cost is not in the row's figures."""
    skip = iters // 2
    if skip < 1:
        return []
    return [
        "--profile",
        "--profile-step-start",
        str(max(0, skip - 2)),
        "--profile-step-end",
        str(skip),
    ]


def anyspeed_row(
    level: int,
    iters: int,
    dry: bool,
    vocab: str,
    timeout: int = 1200,
    profile: bool = False,
    fp8: str | None = None,
) -> dict:
    fp8_flags = ["--fp8-format", "hybrid", "--fp8-recipe", fp8] if fp8 else []
    cmd = [
        sys.executable,
        "-m",
        "anyspeed",
        "pretrain",
        *shape(dry),
        *COMMON,
        "--vocab-size",
        vocab,
        "--train-iters",
        str(iters),
        "--optimization-level",
        str(level),
        "--no-progress-bar",
        *fp8_flags,
        *(profile_window(iters) if profile else []),
    ]
    return _run(f"level {level}", cmd, timeout, skip=iters // 2)


def missing_kernel_flags() -> list[str]:
    """Megatron-LM's defaults that need Transformer Engine's or Apex's kernels, switched off
    where those are absent: Megatron stops without them (RoPE fusion at its config's check,
    gradient-accumulation fusion when it builds a linear layer, the masked softmax at the first
    forward). Its torch.compile'd fusions (bias-SwiGLU, bias-dropout-add) stay on."""
    from importlib.util import find_spec

    needs = [
        ("transformer_engine", "--no-rope-fusion"),
        ("fused_weight_gradient_mlp_cuda", "--no-gradient-accumulation-fusion"),
        ("scaled_upper_triang_masked_softmax_cuda", "--no-masked-softmax-fusion"),
    ]
    return [flag for module, flag in needs if find_spec(module) is None]


def megatron_row(iters: int, dry: bool, vocab: str, timeout: int = 1200) -> dict | None:
    """Megatron-LM's pretrain_gpt.py on the local spec, no anyspeed (None without a checkout;
    the dry run needs a device it can run on, so it runs it only where CUDA is)."""
    import torch

    root = os.environ.get("ANYSPEED_MEGATRON_LM")
    if not root or not torch.cuda.is_available():
        return None
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    script = os.path.join(root, "pretrain_gpt.py")
    cmd = [*torchrun, WRAPPER, script, *megatron_flags(iters, dry, vocab)]
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, CUDA_DEVICE_MAX_CONNECTIONS="1")
    return _run("pretrain_gpt.py", cmd, timeout, skip=iters // 2, env=env)


def megatron_flags(iters: int, dry: bool, vocab: str) -> list[str]:
    """pretrain_gpt.py's flags for the reference row: the same model and batch, the local
    spec, its throughput line, no kernel it does not have."""
    tok = ["--tokenizer-type", "NullTokenizer", "--vocab-size", vocab]
    # no --save: Megatron would write the 1.5B model's checkpoint after the last iteration
    return [
        *shape(dry),
        *COMMON,
        *tok,
        "--train-iters",
        str(iters),
        "--transformer-impl",
        "local",
        "--log-throughput",
        *missing_kernel_flags(),
    ]


def _megatron_flops(ref: dict | None) -> float | None:
    """Megatron's FLOPs per iteration: its TFLOP/s times its time per iteration."""
    if ref and "megatron_tflops" in ref and "ms" in ref:
        return ref["megatron_tflops"] * ref["ms"] * 1e9
    return None


def line(name: str, r: dict | None, flops: float | None) -> str:
    """One row's line; MFU by Megatron's FLOPs where its row ran (``flops``)."""
    if r is None:
        return f"{name:16} skipped (set ANYSPEED_MEGATRON_LM; needs CUDA)"
    if "error" in r:
        return f"{name:16} failed: {r['error']}"
    peak_tflops = r["tflops"] / (r["mfu"] / 100) if r.get("mfu") else None
    if flops and peak_tflops:
        mfu, how = flops / (r["ms"] * 1e9) / peak_tflops * 100, "Megatron's FLOPs"
    else:
        mfu, how = r.get("mfu", float("nan")), "anyspeed's FLOPs"
    tokens, peak = r.get("tokens", float("nan")), r.get("peak", float("nan"))
    # anyspeed prints "MFU: n/a" where it knows no peak for the device (a busy CPU's)
    share = f"MFU {mfu:5.1f}% ({how})" if mfu == mfu else "MFU   n/a (peak unknown)"
    return f"{name:16} {tokens:10.0f} tokens/s {r['ms']:9.1f} ms/iter {share} peak {peak:.2f} GiB"


def table(rows: dict[str, dict | None]) -> list[str]:
    """One line per row; MFU by Megatron's FLOPs where its row ran."""
    flops = _megatron_flops(rows.get("megatron local"))
    return [line(name, r, flops) for name, r in rows.items()]


def main(argv: list[str] | None = None) -> list[str]:
    """Megatron's row first (its FLOPs give every row's MFU), then each level; each line is
    printed as its row ends, so a run cut short still shows the rows it finished."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="a tiny model on this machine's device")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--row-timeout",
        type=int,
        default=1200,
        help="seconds one row may run before it is reported failed",
    )
    p.add_argument(
        "--megatron-timeout",
        type=int,
        help="the same for Megatron's row (default: --row-timeout); its start compiles "
        "Megatron's torch.compile'd fusions",
    )
    p.add_argument(
        "--profile-levels",
        type=int,
        nargs="*",
        default=[0, 2],
        help="the levels whose rows also run torch.profiler over two untimed steps and print "
        "where a step's time goes (none: no profile)",
    )
    p.add_argument(
        "--fp8-recipe",
        choices=("tensorwise", "delayed"),
        help="after each level's row, the same level with --fp8-format hybrid and this recipe "
        "(MFU against the device's bf16 peak)",
    )
    p.add_argument("--no-megatron", action="store_true", help="skip pretrain_gpt.py's row")
    args = p.parse_args(argv)
    vocab = "512" if args.dry else "151936"
    ref = None
    if not args.no_megatron:
        ref = megatron_row(args.iters, args.dry, vocab, args.megatron_timeout or args.row_timeout)
    flops = _megatron_flops(ref)
    lines, peaks = [], []
    for level in args.levels:
        for fp8 in (None, args.fp8_recipe) if args.fp8_recipe else (None,):
            profile = level in args.profile_levels
            r = anyspeed_row(level, args.iters, args.dry, vocab, args.row_timeout, profile, fp8)
            if r.get("mfu") and not fp8:  # the device's peak TFLOP/s anyspeed's MFU line used
                peaks.append(r["tflops"] / (r["mfu"] / 100))
            name = f"anyspeed level {level}" + (" fp8" if fp8 else "")
            lines.append(line(name, r, flops))
            print(lines[-1], flush=True)
            if "profile" in r:  # not a row of the table: printed, not returned
                print(f"  {name[9:]} {r['profile']}", flush=True)
    if args.no_megatron:
        return lines
    if flops and peaks and "mfu" not in ref:  # Megatron prints TFLOP/s, not MFU
        ref = dict(ref, tflops=ref["megatron_tflops"], mfu=ref["megatron_tflops"] / peaks[0] * 100)
    lines.append(line("megatron local", ref, flops))
    print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
