"""Generation of Phi-3.5-style models (LongRoPE's two factor sets and attention factor, RoPE on
3/4 of each head, a sliding window of 10 keys) against transformers' ``generate``, greedy, over
a prompt of 6 and 20 new tokens: the first 10 within the pretraining length (16, the short
factors), then past it, where transformers switches to the long factors and encodes the
sequence again (its cached keys were rotated by the short ones). The tokens with the KV cache
equal those without it and transformers' (without the re-encoding they part at the 12th)."""

from __future__ import annotations

from pathlib import Path

from helpers.family_generation import greedy_three_ways


def test_greedy_within_and_past_the_pretraining_length_equals_transformers(
    tmp_path: Path,
) -> None:
    kv, no_kv, ref = greedy_three_ways(tmp_path, "tiny-phi3", new_tokens=20)
    assert kv == no_kv == ref
