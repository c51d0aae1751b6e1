"""KV-cache generation of Gemma 3 (windowed layers with a RoPE base of their own, the full
layers' linear-scaled RoPE, QK norm, sandwich norms): greedy tokens with the cache equal those
without it and transformers' ``generate`` for a prompt plus answer longer than the window
(4 keys), so the window's edge is crossed and both RoPE tables are sliced past the prompt."""

from __future__ import annotations

from pathlib import Path

from helpers.family_generation import greedy_three_ways


def test_greedy_with_cache_equals_transformers(tmp_path: Path) -> None:
    kv, no_kv, ref = greedy_three_ways(tmp_path, "tiny-gemma3", new_tokens=20)
    assert kv == no_kv == ref
