"""KV-cache generation of DeepSeek-V3 (MLA with low-rank queries in the cache, group-limited
sigmoid routing, a multi-token prediction layer that generation leaves out): greedy tokens with
the cache equal those without it and transformers' ``generate``."""

from __future__ import annotations

from pathlib import Path

import torch
from test_generation import _hf_model

from anyspeed.convert import hf_to_megatron
from anyspeed.testing import run_distributed
from helpers import convert_ranks, infer_ranks


def test_greedy_with_cache_equals_transformers(tmp_path: Path) -> None:
    convert_ranks.tiny_hf_model(tmp_path / "hf", "tiny-deepseek-v3", seed=2)
    convert_ranks.add_mtp_layers(tmp_path / "hf", seed=4)
    hf_to_megatron(tmp_path / "hf", tmp_path / "mg")
    prompt = [3, 14, 15, 92, 65, 35]
    got = run_distributed(infer_ranks.family_greedy, 1, ckpts={"ds3": str(tmp_path / "mg")},
                          new_tokens=16, prompt=prompt, timeout=600)[0]  # fmt: skip
    kv, no_kv = got["ds3"]
    ref = _hf_model(str(tmp_path / "hf")).generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16
    )
    assert kv == no_kv == ref[0, len(prompt) :].tolist()
