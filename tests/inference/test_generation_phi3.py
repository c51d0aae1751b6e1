"""Generation of Phi-3.5-style models (LongRoPE's two factor sets and attention factor, RoPE on
3/4 of each head, a sliding window of 10 keys) against transformers' ``generate``, greedy:
within the pretraining length (16) the tokens with the KV cache equal those without it and
transformers'; past it, transformers switches to the long factors (re-encoding the prompt) and
generation without the cache follows it token for token. With the cache anyspeed takes the set
of the whole generation's length from the start (docs/families.md#phi-3)."""

from __future__ import annotations

from pathlib import Path

from helpers.family_generation import PROMPT, greedy_three_ways


def test_greedy_within_the_pretraining_length_equals_transformers(tmp_path: Path) -> None:
    kv, no_kv, ref = greedy_three_ways(tmp_path, "tiny-phi3", new_tokens=16 - len(PROMPT))
    assert kv == no_kv == ref


def test_greedy_past_it_without_the_cache_equals_transformers(tmp_path: Path) -> None:
    _, no_kv, ref = greedy_three_ways(tmp_path, "tiny-phi3", new_tokens=20)
    assert no_kv == ref
