"""GPT-OSS attention (a sink per head, a causal sliding window) on this device: Megatron's
path (S x S scores, the window as a mask, the sink as one more softmax column) vs anyspeed's
blocked kernel (the online softmax starts from the sink; key blocks outside every window are
skipped), side by side in one run.

For each sequence length (8 heads, head dim 64, batch 1, fp32) it prints forward + backward
time (best of ``--repeats``) of both paths with the window (``--window``, GPT-OSS: 127 keys
before the row) and without (the full-attention layers), the speed-up, and the bytes autograd
saves for backward. ``--cap C``: Gemma 2's attention instead (scores soft-capped as
``C * tanh(s / C)``, no sinks), Megatron's path being what anyspeed runs at level 0.

    python benchmarks/attention_sinks.py [--seqs 1024 2048 4096] [--window 127] [--cap 50]
"""

from __future__ import annotations

import argparse
import math

import torch

from anyspeed.features.ops.blocked_attention import blocked_attention
from attention_dropout import DIM, HEADS, saved_bytes, seconds


def megatron_path(q, k, v, sink, window, cap=None):
    """What Megatron-Core 0.16.1's local attention computes: full scores, masks, SoftmaxOne
    (with ``cap``: the soft-cap anyspeed's hook applies before the mask, and no sink)."""
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if cap:
        scores = torch.tanh(scores / cap) * cap
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s)
    masked = j > i if window is None else (j > i) | (i - j > window)
    scores = scores.masked_fill(masked, -10000.0)
    if sink is None:
        return torch.softmax(scores, dim=-1) @ v
    col = sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--window", type=int, default=127)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cap", type=float, default=None, help="Gemma 2: soft-cap, no sinks")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.backends.cpu.get_cpu_capability()
    kind = f"soft-cap {args.cap:g}, no sinks" if args.cap else "sinks"
    print(f"{cpu}, threads {args.threads}, heads {HEADS}, head dim {DIM}, fp32, {kind}; "
          f"forward + backward seconds, saved MiB")  # fmt: skip
    print(f"{'seq':>5} {'window':>7} {'megatron s':>11} {'blocked s':>10} {'speed-up':>9} "
          f"{'megatron MiB':>13} {'blocked MiB':>12}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    sink = None if args.cap else torch.randn(HEADS, generator=gen).requires_grad_()
    for s in args.seqs:
        q, k, v = (torch.randn(1, HEADS, s, DIM, generator=gen).requires_grad_() for _ in "qkv")
        grad = torch.randn(1, HEADS, s, DIM, generator=gen)
        for window in (args.window, None):
            paths = {
                "megatron": lambda q, k, v, w=window: megatron_path(q, k, v, sink, w, args.cap),
                "blocked": lambda q, k, v, w=window: blocked_attention(
                    q, k, v, causal=True, sink=sink, window=w, cap=args.cap
                ),
            }
            t = {n: seconds(fn, q, k, v, grad, args.repeats) for n, fn in paths.items()}
            mem = {n: saved_bytes(fn, q, k, v) / 2**20 for n, fn in paths.items()}
            w = "full" if window is None else str(window)
            print(f"{s:>5} {w:>7} {t['megatron']:>11.3f} {t['blocked']:>10.3f} "
                  f"{t['megatron'] / t['blocked']:>8.2f}x {mem['megatron']:>13.1f} "
                  f"{mem['blocked']:>12.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
