"""Decoding a batch whose rows end at different steps: ended rows leaving the batch (and its
KV cache) against the whole batch stepped to its longest row, side by side in one run.

A random GPT model (Megatron-Core through anyspeed, level 1: the lean decode step) samples
``--batch`` prompts with a generator per row, as a rollout does. ``--end-ids`` of the
``--vocab`` tokens end an answer, so with a near-uniform fresh model an answer ends at each
token with probability ``end-ids / vocab`` (lengths roughly geometric, capped at ``--new``).
Rounds alternate the two ways; each keeps its best of ``--repeats``; tokens are checked equal.

    python benchmarks/ragged_decode.py [--batch 64] [--new 256] [--hidden 512] [--layers 4]
        [--vocab 4096] [--end-ids 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from anyspeed import quiet

quiet.install()

from anyspeed.testing import run_distributed  # noqa: E402


def ranked(a: argparse.Namespace) -> dict:
    """This rank's timings of both ways and whether their tokens agree."""
    from dataclasses import replace

    from anyspeed import adaptor
    from anyspeed.distributed.groups import init_distributed
    from anyspeed.inference.decode import Request, sample
    from anyspeed.inference.sampling import SamplingParams
    from anyspeed.layout import Layout
    from anyspeed.models import gpt
    from anyspeed.models.config import ModelConfig

    adaptor.apply(argv=["--optimization-level", "1"])
    layout = Layout()
    init_distributed(layout, seed=0)
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=a.hidden * 8 // 3,
                      num_attention_heads=8, num_query_groups=4, vocab_size=a.vocab)  # fmt: skip
    torch.manual_seed(0)
    model = [c.eval() for c in gpt.build_chunks(cfg, gpt.transformer_config(cfg, layout), layout)]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, a.vocab - a.end_ids, (32,), generator=gen).tolist()
               for _ in range(a.batch)]  # fmt: skip
    req = Request(a.new, SamplingParams(greedy=False), eos_ids=tuple(range(a.vocab - a.end_ids,
                  a.vocab)), row_seeds=tuple(range(a.batch)), vocab_size=a.vocab)  # fmt: skip
    best = {"compacted": float("inf"), "whole batch": float("inf")}
    out = {}
    with torch.inference_mode():
        for _ in range(a.repeats):
            for name, r in (("compacted", req), ("whole batch", replace(req, compact=False))):
                t0 = time.perf_counter()
                out[name] = sample(model, prompts, r)[0]
                best[name] = min(best[name], time.perf_counter() - t0)
    lengths = [len(t) for t in out["compacted"]]
    return {"best": best, "same": out["compacted"] == out["whole batch"], "lengths": lengths}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--batch", 64), ("--new", 256), ("--hidden", 512), ("--layers", 4),
                          ("--vocab", 4096), ("--end-ids", 64), ("--repeats", 3)):  # fmt: skip
        p.add_argument(flag, type=int, default=default)
    a = p.parse_args()
    res = run_distributed(ranked, 1, a=a, timeout=3600)[0]
    n = res["lengths"]
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}, fp32, hidden {a.hidden}, "
          f"{a.layers} layers, batch {a.batch}, answers {min(n)}-{max(n)} tokens (mean "
          f"{sum(n) / len(n):.0f}, cap {a.new}), tokens equal: {res['same']}")  # fmt: skip
    total = sum(n)
    for name, s in res["best"].items():
        print(f"  {name:11s} {s:6.2f} s  {total / s:8.0f} sampled tokens/s")
    b = res["best"]
    print(f"  compacted / whole batch: {b['whole batch'] / b['compacted']:.2f}x faster")


if __name__ == "__main__":
    main()
