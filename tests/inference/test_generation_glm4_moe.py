"""KV-cache generation of GLM-4.5 (RoPE on half of each head, QK norm, Q/K/V biases, sigmoid
routing): greedy tokens with the cache equal those without it and transformers' ``generate``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_generation import _hf_model

from anyspeed.convert import hf_to_megatron
from anyspeed.testing import run_distributed
from helpers import convert_ranks, infer_ranks


@pytest.mark.slow  # ~15 s; the forward's fast twin is tests/convert/test_convert_glm4_moe.py
def test_greedy_with_cache_equals_transformers(tmp_path: Path) -> None:
    convert_ranks.tiny_hf_model(tmp_path / "hf", "tiny-glm-4.5", seed=2)
    hf_to_megatron(tmp_path / "hf", tmp_path / "mg")
    prompt = [3, 14, 15, 92, 65, 35]
    got = run_distributed(infer_ranks.family_greedy, 1, ckpts={"glm": str(tmp_path / "mg")},
                          new_tokens=16, prompt=prompt, timeout=600)[0]  # fmt: skip
    kv, no_kv = got["glm"]
    ref = _hf_model(str(tmp_path / "hf")).generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16
    )
    assert kv == no_kv == ref[0, len(prompt) :].tolist()
