"""KV-cache generation of DeepSeek-V3.2: each layer's indexer keys are cached beside the MLA
cache, and every new token's query picks its keys among all of them. 24 greedy tokens after a
6-token prompt (the tiny model keeps 6 keys per query, so most steps attend sparsely) with the
cache equal those without it and transformers' ``generate``."""

from __future__ import annotations

from pathlib import Path

from helpers.family_generation import greedy_three_ways


def test_greedy_with_cache_equals_transformers(tmp_path: Path) -> None:
    kv, no_kv, ref = greedy_three_ways(tmp_path, "tiny-deepseek-v3.2", new_tokens=24)
    assert kv == no_kv == ref
