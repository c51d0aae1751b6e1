"""Generation of Qwen3.5's text model (the gated DeltaNets' recurrent state and the attention
layers' KV cache): greedy tokens with the cache equal those without it and transformers'
``generate``."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.family_generation import greedy_three_ways


@pytest.mark.slow  # ~15 s; the forward's fast twin is tests/convert/test_convert_qwen3_5.py
@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_greedy_with_cache_equals_transformers(tmp_path: Path, preset: str) -> None:
    kv, no_kv, ref = greedy_three_ways(tmp_path, preset)
    assert kv == no_kv == ref
