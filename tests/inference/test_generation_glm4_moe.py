"""KV-cache generation of GLM-4.5 (RoPE on half of each head, QK norm, Q/K/V biases, sigmoid
routing): greedy tokens with the cache equal those without it and transformers' ``generate``."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.family_generation import greedy_three_ways


@pytest.mark.slow  # ~15 s; the forward's fast twin is tests/convert/test_convert_glm4_moe.py
def test_greedy_with_cache_equals_transformers(tmp_path: Path) -> None:
    kv, no_kv, ref = greedy_three_ways(tmp_path, "tiny-glm-4.5")
    assert kv == no_kv == ref
