"""Token sampling speed on the CPU: anyspeed's ``next_tokens`` against the usual formula
(temperature, top-k by ``topk``, top-p by a full sort, ``torch.multinomial``, as transformers'
samplers and anyspeed before 2026-12-06 do it), side by side in one run.

Random logits at batch ``--batch`` (64) for a small and a Qwen-sized vocabulary; ``peaked``
logits (N(0, 3)) give a narrow top-p nucleus, ``flat`` ones (N(0, 0.3)) a wide one. Each row
is the best of ``--repeats`` calls.

    python benchmarks/sampling.py [--batch 64] [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from anyspeed.inference.sampling import SamplingParams, next_tokens

CASES = [  # (logits scale, temperature, top_k, top_p)
    ("peaked", 3.0, 0.7, 0, 1.0),
    ("peaked", 3.0, 0.7, 0, 0.9),
    ("peaked", 3.0, 0.7, 50, 0.9),
    ("flat", 0.3, 1.0, 0, 0.9),
]


def usual(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """The usual formula: scale, top-k, top-p over a full sort, ``torch.multinomial``."""
    out = logits.float() / p.temperature
    if p.top_k:
        out = out.masked_fill(out < torch.topk(out, p.top_k).values[..., -1:], float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        out = out.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(out.softmax(-1), 1, generator=gen)[:, 0]


def best(fn, repeats: int) -> float:  # noqa: ANN001 - a no-argument callable
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--batch", type=int, default=64)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--repeats", type=int, default=5)
    args = a.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"sampling one token per row, batch {args.batch}, {torch.get_num_threads()} threads")
    print(f"{'vocab':>7} {'logits':>7} {'temp':>5} {'top-k':>6} {'top-p':>6} "
          f"{'usual ms':>9} {'anyspeed ms':>12} {'ratio':>6}")  # fmt: skip
    for vocab in (4096, 151936):
        for name, scale, temp, top_k, top_p in CASES:
            logits = torch.randn(args.batch, vocab, generator=gen) * scale
            p = SamplingParams(greedy=False, temperature=temp, top_k=top_k, top_p=top_p)
            ref = best(lambda: usual(logits, p, gen), args.repeats)  # noqa: B023
            ours = best(lambda: next_tokens(logits, p, gen), args.repeats)  # noqa: B023
            print(f"{vocab:>7} {name:>7} {temp:>5} {top_k:>6} {top_p:>6} {ref * 1e3:>9.1f} "
                  f"{ours * 1e3:>12.1f} {ref / ours:>5.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
