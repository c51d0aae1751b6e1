"""One check the family generation tests share: a tiny random HF model of a preset, converted,
generates greedily with and without the KV cache, and transformers' ``generate`` too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

PROMPT = [3, 14, 15, 92, 65, 35]


def greedy_three_ways(
    root: Path,
    preset: str,
    new_tokens: int = 16,
    prepare: Callable[[Path], None] | None = None,
) -> tuple[list, list, list]:
    """(KV cache, no cache, transformers) greedy new tokens of ``preset``'s tiny random model;
    ``prepare`` edits the HF directory first (e.g. adds MTP layers)."""
    from transformers import AutoModelForCausalLM

    from anyspeed.convert import hf_to_megatron
    from anyspeed.testing import run_distributed
    from helpers import convert_ranks, infer_ranks

    convert_ranks.tiny_hf_model(root / "hf", preset, seed=2)
    if prepare is not None:
        prepare(root / "hf")
    hf_to_megatron(root / "hf", root / "mg")
    got = run_distributed(infer_ranks.family_greedy, 1, ckpts={"m": str(root / "mg")},
                          new_tokens=new_tokens, prompt=PROMPT, timeout=600)[0]  # fmt: skip
    kv, no_kv = got["m"]
    model = AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # random weights: run the full budget
    model.generation_config.pad_token_id = 0
    ref = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens)  # fmt: skip
    return kv, no_kv, ref[0, len(PROMPT) :].tolist()
