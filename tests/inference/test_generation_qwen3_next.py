"""Generation with Qwen3-Next's hybrid cache (keys and values for the gated attention layer, the
convolution's last inputs and the delta rule's state for the DeltaNet layers): greedy tokens of
a left-padded batch with the cache equal transformers' ``generate`` of each prompt alone, at TP1
and TP2; without the cache too; beam search with the cache (the states follow the beams) equals
beam search without it."""

from __future__ import annotations

from pathlib import Path

import torch
from test_generation import _hf_model

from anyspeed.convert import hf_to_megatron
from anyspeed.testing import run_distributed
from helpers import convert_ranks, infer_ranks

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82], [11, 8, 3, 500, 7]]


def test_greedy_with_cache_equals_transformers(tmp_path: Path) -> None:
    convert_ranks.tiny_hf_model(tmp_path / "hf", "tiny-qwen3-next", seed=2)
    hf_to_megatron(tmp_path / "hf", tmp_path / "mg")
    got = run_distributed(infer_ranks.generation_cases, 2, ckpt=str(tmp_path / "mg"),
                          layouts=[(1, 1), (2, 1)], prompts=PROMPTS, new_tokens=12, vocab=512,
                          beam_tokens=6, timeout=900)[0]  # fmt: skip
    hf = _hf_model(str(tmp_path / "hf"))
    want = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12,
                        min_new_tokens=12)[0, len(p) :].tolist() for p in PROMPTS]  # fmt: skip
    for layout in ("tp1pp1", "tp2pp1"):
        res = got[layout]
        assert res["greedy_kv1"] == want, layout
        assert res["greedy_kv0"] == want, layout
        assert res["beam_kv1"] == res["beam_kv0"], layout
