"""KV-cache generation of Gemma 2 (soft-capped scores, a sliding window in the cache, sandwich
norms, scaled embeddings): greedy tokens with the cache equal those without it and
transformers' ``generate`` for a prompt plus answer longer than the window (4 keys), so the
window's edge is crossed. (Greedy tokens cannot see the logits' soft-cap, a monotone map: the
conversion test compares the logits.)"""

from __future__ import annotations

from pathlib import Path

from helpers.family_generation import greedy_three_ways


def test_greedy_with_cache_equals_transformers(tmp_path: Path) -> None:
    kv, no_kv, ref = greedy_three_ways(tmp_path, "tiny-gemma2", new_tokens=20)
    assert kv == no_kv == ref
