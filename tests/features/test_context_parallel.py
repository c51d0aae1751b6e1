"""Context-parallel attention (Ulysses, ring, hybrid) vs. single-device causal attention, fp32.

Outputs and input gradients of every rank's shard must equal the single-device result within
1e-5 max-abs, with and without GQA, at sequence lengths that exercise the load-balanced split,
through the CPU flash kernels and through the plain-math fallback.
"""

from __future__ import annotations

import pytest

from anyspeed.testing import run_distributed
from helpers import feature_ranks

CASES = [
    ("ring", 2, 4, 4, 24),
    ("ring", 2, 4, 2, 40),  # GQA
    ("ring", 4, 4, 1, 48),  # GQA, a single K/V head
    ("ring", 4, 8, 8, 16),  # 2 tokens per chunk
    ("ulysses", 2, 4, 4, 24),
    ("ulysses", 2, 4, 2, 30),
    ("ulysses", 4, 4, 1, 40),  # fewer K/V heads than the Ulysses degree: replicated
    ("ulysses", 4, 8, 4, 16),
    ("hybrid", 4, 4, 4, 32),  # Ulysses 2 x ring 2
    ("hybrid", 4, 4, 1, 48),  # GQA with a single K/V head
]


# The blockwise pieces of ring / hybrid in plain math (the portable fallback) as well.
CASES += [(a, w, h, kv, s, False) for a, w, h, kv, s in (("ring", 4, 4, 1, 48),
                                                          ("hybrid", 4, 4, 4, 32))]  # fmt: skip
CASES = [c if len(c) == 6 else (*c, True) for c in CASES]


NAMES = ("algo", "world", "heads", "kv_heads", "seq", "fused")


@pytest.fixture(scope="module")
def results():
    """Every case, run in one process group per world size (spawning is the slow part)."""
    out = {}
    for world in sorted({c[1] for c in CASES}):
        mine = [c for c in CASES if c[1] == world]
        kwargs = [{k: v for k, v in zip(NAMES, c, strict=True) if k != "world"} for c in mine]
        per_rank = run_distributed(feature_ranks.cp_attention_cases, world, cases=kwargs,
                                   timeout=300)  # fmt: skip
        for i, case in enumerate(mine):
            out[case] = [rank_results[i] for rank_results in per_rank]
    return out


@pytest.mark.parametrize("algo,world,heads,kv_heads,seq,fused", CASES)
def test_cp_attention_matches_single_device(results, algo, world, heads, kv_heads, seq, fused):
    for rank, diffs in enumerate(results[(algo, world, heads, kv_heads, seq, fused)]):
        assert max(diffs.values()) <= 1e-5, (rank, diffs)
