"""Generation with Qwen3-Next's hybrid cache (keys and values for the gated attention layer, the
convolution's last inputs and the delta rule's state for the DeltaNet layers): greedy tokens of
a left-padded batch with the cache equal transformers' ``generate`` of each prompt alone, at TP1
and TP2 (``-m slow``); without the cache too; with rows ending apart (ended rows leave the batch
and the DeltaNet states); beam search with the cache (the states follow the
beams) equals beam search without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_generation import _hf_model

from anyspeed.convert import hf_to_megatron
from anyspeed.testing import run_distributed
from helpers import convert_ranks, infer_ranks

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82], [11, 8, 3, 500, 7]]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    d = tmp_path_factory.mktemp("qwen3_next_gen")
    convert_ranks.tiny_hf_model(d / "hf", "tiny-qwen3-next", seed=2)
    hf_to_megatron(d / "hf", d / "mg")
    hf = _hf_model(str(d / "hf"))
    want = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12,
                        min_new_tokens=12)[0, len(p) :].tolist() for p in PROMPTS]  # fmt: skip
    return d / "mg", want


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_greedy_with_cache_equals_transformers(converted, tp: int) -> None:
    mg, want = converted
    eos = (want[0][3], want[1][7])  # rows end apart: ended ones leave the batch and states
    got = run_distributed(infer_ranks.generation_cases, tp, ckpt=str(mg), layouts=[(tp, 1)],
                          prompts=PROMPTS, new_tokens=12, vocab=512, beam_tokens=6, eos=eos,
                          timeout=900)[0][f"tp{tp}pp1"]  # fmt: skip
    assert got["greedy_kv1"] == want
    assert got["greedy_kv0"] == want
    assert got["beam_kv1"] == got["beam_kv0"]
    ended = [next((row[: i + 1] for i, t in enumerate(row) if t in eos), row) for row in want]
    assert got["greedy_eos"] == ended
    assert len({len(r) for r in ended}) > 1
