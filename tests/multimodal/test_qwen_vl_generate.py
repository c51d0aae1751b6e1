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


@pytest.mark.parametrize(
    "kind,tp,pp",
    [("qwen2_5_vl", 1, 1), ("qwen2_5_vl", 2, 1), ("qwen2_5_vl", 1, 2),
     pytest.param("qwen2_vl", 2, 1, marks=pytest.mark.slow)],
)  # fmt: skip
def test_greedy_tokens_equal_transformers(kind, tp, pp, tmp_path):
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
        got = run_distributed(qwen_vl_ranks.qwen_vl_generate, tp * pp, state=state,
                              config_json=config, tp=tp, pp=pp, inputs=dict(inputs), n=NEW,
                              cache=cache)  # fmt: skip
        assert all(r["tokens"] == [want] for r in got), (cache, got[0]["tokens"], want)


def test_generate_command_prints_transformers_answer(tmp_path, capsys):
    """``anyspeed generate --load HF_DIR --image F --video DIR``: the printed answer is the
    decoded greedy tokens of transformers' forward on the same rendered prompt and pixels; a
    missing frame folder and beam search are one line."""
    import transformers as T
    from PIL import Image

    from anyspeed.commands.generate import main as generate_main
    from anyspeed.commands.qwen_image import prompt_ids
    from anyspeed.data.qwen_vl_pixels import Pixels, processor_settings
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.models.qwen_vl.spec import QwenVLSpec
    from anyspeed.stages.vlm.qwen_data import vision_inputs

    d = q.make_model(str(tmp_path / "hf"), "qwen2_5_vl", jitter=0.5)
    image, frames = tmp_path / "a.png", tmp_path / "frames"
    Image.new("RGB", (24, 32), (200, 30, 30)).save(image)
    frames.mkdir()
    for k in range(4):
        Image.new("RGB", (16, 16), (10, 40 * k, 10)).save(frames / f"{k}.png")
    argv = ["--load", d, "--image", str(image), "--video", str(frames), "--max-new-tokens", "12",
            "--prompt", "what is in the picture?"]  # fmt: skip
    capsys.readouterr()
    assert generate_main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]

    config = json.loads(open(f"{d}/config.json").read())
    tok = load_tokenizer(TokenizerSpec(name_or_path=d))
    spec = QwenVLSpec(config, None, processor_settings(d, 2, 2, 2))  # type: ignore[arg-type]
    import argparse

    args = argparse.Namespace(prompt=["what is in the picture?"], image=[str(image)],
                              video=[str(frames)], max_image_pixels=1 << 30)  # fmt: skip
    ids, sample = prompt_ids(args, tok, spec)
    inputs = {"input_ids": torch.tensor([ids]),
              **vision_inputs(list(sample.images), list(sample.videos),
                              Pixels(spec.processor), True)}  # fmt: skip
    hf = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(d, attn_implementation="eager")
    want = _hf_greedy_until(hf.eval(), config, inputs, 12, tok.eod_id)
    assert printed == tok.backend.decode(want)
    assert generate_main([*argv, "--video", str(tmp_path / "none")]) == 2
    assert "--video" in capsys.readouterr().err
    assert generate_main([*argv, "--task", "beam_search"]) == 2


@torch.no_grad()
def _hf_greedy_until(hf, config: dict, inputs: dict, n: int, end: int) -> list[int]:
    """transformers' forward, greedily (no vision marker), at most ``n`` tokens up to ``end``."""
    ids, vision = inputs["input_ids"], {k: v for k, v in inputs.items() if k != "input_ids"}
    out = []
    for _ in range(n):
        hf.model.rope_deltas = None
        logits = hf(input_ids=ids, mm_token_type_ids=_types(ids, config), **vision).logits[0, -1]
        logits[_vision_ids(config)] = -torch.inf
        nxt = int(logits.argmax())
        if nxt == end:
            break
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return out


def _rows(config: dict) -> list[dict]:
    """Three prompts of different lengths: an image and a video, another image, text only."""
    full = _verify_inputs(config)
    ids = full["input_ids"]
    g = torch.Generator().manual_seed(5)
    image = torch.tensor([[1, 4, 8]])
    block = [config["vision_start_token_id"], *[config["image_token_id"]] * 8,
             config["vision_end_token_id"]]  # fmt: skip
    text = torch.cat([ids[:, :4], ids[:, -4:]], 1)  # _verify_inputs' text: 4 tokens each end
    second = {"input_ids": torch.cat([text[:, :3], torch.tensor([block]), text[:, 3:]], 1),
              "pixel_values": torch.randn(32, full["pixel_values"].shape[1], generator=g),
              "image_grid_thw": image}  # fmt: skip
    return [full, second, {"input_ids": text[:, 1:]}]


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_left_padded_batch_equals_each_prompt_alone(tp, tmp_path):
    """Three prompts (image + video, image, text only) left-padded into one batch: each row's
    32 greedy tokens (KV cache) equal transformers' on that prompt alone (Qwen2.5-VL)."""
    import transformers as T

    from anyspeed.convert.hf_io import HFCheckpoint
    from anyspeed.convert.qwen_vl import current_name, model_to_megatron

    d = q.make_model(str(tmp_path / "m"), "qwen2_5_vl", jitter=0.5)
    config = json.loads(open(f"{d}/config.json").read())
    hf = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(d, attn_implementation="eager")
    rows = _rows(config)
    want = [_hf_greedy(hf.eval(), config, dict(r)) for r in rows]
    width = max(r["input_ids"].shape[1] for r in rows)
    pad = torch.tensor([width - r["input_ids"].shape[1] for r in rows])
    ids = torch.cat([torch.cat([torch.zeros(1, int(p), dtype=torch.long), r["input_ids"]], 1)
                     for p, r in zip(pad, rows, strict=True)])  # fmt: skip
    batch = {"input_ids": ids}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                "second_per_grid_ts"):  # fmt: skip
        parts = [r[key] for r in rows if key in r]
        if parts:
            batch[key] = torch.cat(parts)
    ck = HFCheckpoint(d)
    names = {current_name(n): n for n in ck.names}
    _, _, state = model_to_megatron(config, lambda n: ck.get(names[n]))
    got = run_distributed(qwen_vl_ranks.qwen_vl_generate, tp, state=state, config_json=config,
                          tp=tp, inputs=batch, n=NEW, pad=pad)  # fmt: skip
    assert all(r["tokens"] == want for r in got), (got[0]["tokens"], want)


def test_chat_about_an_image(tmp_path, capsys):
    """``--task chat`` with an image: two scripted turns; the second answer is transformers'
    greedy continuation of the whole rendered conversation (the first answer in it)."""
    import argparse

    import transformers as T
    from PIL import Image

    from anyspeed.commands.generate import main as generate_main
    from anyspeed.commands.qwen_image import prompt_ids
    from anyspeed.data.qwen_vl_pixels import Pixels, processor_settings
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.models.qwen_vl.spec import QwenVLSpec
    from anyspeed.stages.vlm.qwen_data import vision_inputs

    d = q.make_model(str(tmp_path / "hf"), "qwen2_5_vl", jitter=0.5)
    image = tmp_path / "a.png"
    Image.new("RGB", (32, 32), (30, 200, 30)).save(image)
    capsys.readouterr()
    assert generate_main(["--load", d, "--image", str(image), "--task", "chat", "--top-k", "1",
                          "--prompt", "what is in the picture?", "--prompt", "what colour?",
                          "--max-new-tokens", "6"]) == 0  # fmt: skip
    answers = [x.split("anyspeed >> ", 1)[1] for x in capsys.readouterr().out.splitlines()
               if x.startswith("anyspeed >> ")]  # fmt: skip
    assert len(answers) == 2
    config = json.loads(open(f"{d}/config.json").read())
    tok = load_tokenizer(TokenizerSpec(name_or_path=d))
    spec = QwenVLSpec(config, None, processor_settings(d, 2, 2, 2))  # type: ignore[arg-type]
    args = argparse.Namespace(prompt=[], image=[str(image)], video=[], max_image_pixels=1 << 30)
    turns = [{"role": "user", "content": "what is in the picture?"},
             {"role": "assistant", "content": answers[0]},
             {"role": "user", "content": "what colour?"}]  # fmt: skip
    ids, sample = prompt_ids(args, tok, spec, turns)
    inputs = {"input_ids": torch.tensor([ids]),
              **vision_inputs(list(sample.images), [], Pixels(spec.processor), True)}  # fmt: skip
    hf = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(d, attn_implementation="eager")
    want = _hf_greedy_until(hf.eval(), config, inputs, 6, tok.eod_id)
    assert answers[1] == tok.backend.decode(want)
