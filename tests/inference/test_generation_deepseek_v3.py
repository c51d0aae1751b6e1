"""KV-cache generation of DeepSeek-V3 (MLA with low-rank queries in the cache, group-limited
sigmoid routing, a multi-token prediction layer that generation leaves out): greedy tokens with
the cache equal those without it and transformers' ``generate``."""

from __future__ import annotations

from pathlib import Path

from helpers import convert_ranks
from helpers.family_generation import greedy_three_ways


def test_greedy_with_cache_equals_transformers(tmp_path: Path) -> None:
    kv, no_kv, ref = greedy_three_ways(
        tmp_path, "tiny-deepseek-v3", prepare=lambda d: convert_ranks.add_mtp_layers(d, seed=4)
    )
    assert kv == no_kv == ref
