"""Generation of Phi-3.5-style models (LongRoPE's two factor sets and attention factor, RoPE on
3/4 of each head, a sliding window of 10 keys) against transformers' ``generate``, greedy:
within the pretraining length (16) and past it, where transformers switches to the long
factors and encodes the sequence again (its cached keys were rotated by the short ones), the
tokens with the KV cache equal those without it and transformers'."""

from __future__ import annotations

from pathlib import Path

from helpers.family_generation import PROMPT, greedy_three_ways


def test_greedy_within_the_pretraining_length_equals_transformers(tmp_path: Path) -> None:
    kv, no_kv, ref = greedy_three_ways(tmp_path, "tiny-phi3", new_tokens=16 - len(PROMPT))
    assert kv == no_kv == ref


def test_greedy_past_it_equals_transformers(tmp_path: Path) -> None:
    kv, no_kv, ref = greedy_three_ways(tmp_path, "tiny-phi3", new_tokens=20)
    assert kv == no_kv == ref
