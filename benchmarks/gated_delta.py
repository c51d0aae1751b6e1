"""Qwen3-Next's gated delta rule on this device: the token-by-token form vs the chunked form
(``anyspeed.features.ops.gated_delta``), side by side in one run.

For each sequence length (batch 1, 8 heads, key and value head dim 128 as Qwen3-Next's, fp32,
the query/key L2 norm on) it prints forward + backward time (best of ``--repeats``) of both forms
and the speed-up of the chunked one.

    python benchmarks/gated_delta.py [--seqs 256 1024 2048] [--chunk 64] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from anyspeed.features.ops.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule

HEADS, DK, DV = 8, 128, 128


def seconds(fn, inputs: list[torch.Tensor], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out, _ = fn(*inputs)
        out.sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"gated delta rule, {HEADS} heads x dk {DK} x dv {DV}, fp32, {args.threads} threads; "
          f"forward + backward, best of {args.repeats}")  # fmt: skip
    print(f"{'tokens':>7} | {'token by token':>15} | {'chunked':>10} | speed-up")
    for t in args.seqs:
        g = torch.Generator().manual_seed(t)
        q, k = (torch.randn(1, t, HEADS, DK, generator=g) for _ in range(2))
        v = torch.randn(1, t, HEADS, DV, generator=g)
        decay, beta = -torch.rand(1, t, HEADS, generator=g), torch.rand(1, t, HEADS, generator=g)
        inputs = [x.requires_grad_() for x in (q, k, v, decay, beta)]

        def rec(*x):
            return recurrent_gated_delta_rule(*x, use_qk_l2norm=True)

        def chunk(*x):
            return chunk_gated_delta_rule(*x, chunk_size=args.chunk, use_qk_l2norm=True)

        a, b = seconds(rec, inputs, args.repeats), seconds(chunk, inputs, args.repeats)
        print(f"{t:>7} | {a * 1e3:>12.1f} ms | {b * 1e3:>7.1f} ms | {a / b:>6.1f}x")


if __name__ == "__main__":
    main()
