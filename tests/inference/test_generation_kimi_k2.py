"""KV-cache generation of Kimi-K2 (DeepSeek-V3's MLA and sigmoid routing without groups, YaRN
with beta_fast = beta_slow = 1): greedy tokens with the cache equal those without it and
transformers' ``generate``."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.family_generation import greedy_three_ways


@pytest.mark.slow  # ~15 s; the forward's fast twin is tests/convert/test_convert_kimi_k2.py
def test_greedy_with_cache_equals_transformers(tmp_path: Path) -> None:
    kv, no_kv, ref = greedy_three_ways(tmp_path, "tiny-kimi-k2")
    assert kv == no_kv == ref
