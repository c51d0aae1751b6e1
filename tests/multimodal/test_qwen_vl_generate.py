"""Greedy generation of a Qwen2.5-VL / Qwen2-VL model with the KV cache and the mRoPE decoding
offset: 32 tokens identical to transformers' on a prompt with an image and a 4-frame video, at
TP1 and TP2.

The reference is transformers' own forward over the whole sequence at each step (its
``get_rope_index`` positions). transformers 5.25's ``generate`` is not: on these prompts it
places the prompt's tokens differently from its own forward (measured on the Qwen2.5-VL video
prompt: the text after the video one position earlier, so its second token already differs from
its forward's)."""

from __future__ import annotations

import json

import pytest
import torch

from anyspeed.convert.qwen_vl_api import _verify_inputs
from anyspeed.demo import qwen_vl_data as q
from anyspeed.testing import run_distributed
from helpers import qwen_vl_ranks

NEW = 32


def _types(ids: torch.Tensor, config: dict) -> torch.Tensor:
    return (ids == config["image_token_id"]).int() + 2 * (ids == config["video_token_id"]).int()


def _vision_ids(config: dict) -> list[int]:
    return [config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                "vision_end_token_id")]  # fmt: skip


@torch.no_grad()
def _hf_greedy(hf, config: dict, inputs: dict) -> list[int]:
    """transformers' own forward over the whole sequence at each step, vision tokens never
    picked (a generated ``<|video_pad|>`` would have no features)."""
    ids = inputs["input_ids"]
    vision = {k: v for k, v in inputs.items() if k != "input_ids"}
    for _ in range(NEW):
        hf.model.rope_deltas = None
        logits = hf(input_ids=ids, mm_token_type_ids=_types(ids, config), **vision).logits[:, -1]
        logits[:, _vision_ids(config)] = -torch.inf
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("kind,tp", [("qwen2_5_vl", 1), ("qwen2_5_vl", 2), ("qwen2_vl", 2)])
def test_greedy_tokens_equal_transformers(kind, tp, tmp_path):
    import transformers as T

    from anyspeed.convert.hf_io import HFCheckpoint
    from anyspeed.convert.qwen_vl import current_name, model_to_megatron

    d = q.make_model(str(tmp_path / kind), kind, jitter=0.5)  # varied tokens, not one repeated
    config = json.loads(open(f"{d}/config.json").read())
    hf = getattr(T, config["architectures"][0]).from_pretrained(d, attn_implementation="eager")
    inputs = _verify_inputs(config)
    want = _hf_greedy(hf.eval(), config, dict(inputs))
    assert len(set(want)) > 8  # a sequence that tells positions apart
    ck = HFCheckpoint(d)
    names = {current_name(n): n for n in ck.names}
    _, _, state = model_to_megatron(config, lambda n: ck.get(names[n]))
    for cache in (True, False):
        got = run_distributed(qwen_vl_ranks.qwen_vl_generate, tp, state=state, config_json=config,
                              tp=tp, inputs=dict(inputs), n=NEW, cache=cache)  # fmt: skip
        assert all(r["tokens"] == [want] for r in got), (cache, got[0]["tokens"], want)
