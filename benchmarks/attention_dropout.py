"""Attention with dropout on the CPU: the math fallback vs anyspeed's blocked kernel, one run.

PyTorch's fused CPU attention kernels refuse dropout, so ``scaled_dot_product_attention`` with
``dropout_p > 0`` runs the math kernel (S x S probabilities and mask kept for backward). For
sequence lengths up to 2048 (8 heads, head dim 64, batch 1, causal, dropout 0.1, fp32) it prints
forward + backward time (best of ``--repeats``) of the math path, of the blocked kernel, and of
the fused flash kernel without dropout (the floor), the speed-up of blocked over math, and the
bytes autograd saves for backward (unique storages, inputs included) by each path.

    python benchmarks/attention_dropout.py [--seqs 512 1024 2048] [--threads N] [--block 256]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from anyspeed.features.ops.blocked_attention import BLOCK, blocked_attention

HEADS, DIM, P = 8, 64, 0.1


def saved_bytes(fn, q, k, v) -> int:
    """Bytes of the unique storages autograd keeps for the backward of ``fn(q, k, v)``."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, k, v)
    return sum(storages.values())


def seconds(fn, q, k, v, grad, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(q, k, v).backward(grad)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--block", type=int, default=BLOCK)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paths = {
        "math": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, dropout_p=P, is_causal=True
        ),  # fmt: skip
        "blocked": lambda q, k, v: blocked_attention(
            q, k, v, causal=True, dropout_p=P, block=args.block
        ),  # fmt: skip
        "flash, no dropout": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True
        ),
    }
    print(f"threads {args.threads}, heads {HEADS}, head dim {DIM}, dropout {P}, block "
          f"{args.block}; forward + backward seconds, saved MiB")  # fmt: skip
    print(f"{'seq':>5} {'math s':>8} {'blocked s':>10} {'flash(no drop) s':>17} {'speed-up':>9} "
          f"{'math MiB':>9} {'blocked MiB':>12}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for s in args.seqs:
        q, k, v = (torch.randn(1, HEADS, s, DIM, generator=gen).requires_grad_() for _ in "qkv")
        grad = torch.randn(1, HEADS, s, DIM, generator=gen)
        t = {name: seconds(fn, q, k, v, grad, args.repeats) for name, fn in paths.items()}
        mem = {name: saved_bytes(paths[name], q, k, v) / 2**20 for name in ("math", "blocked")}
        print(f"{s:>5} {t['math']:>8.3f} {t['blocked']:>10.3f} {t['flash, no dropout']:>17.3f} "
              f"{t['math'] / t['blocked']:>8.2f}x {mem['math']:>9.1f} {mem['blocked']:>12.2f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
