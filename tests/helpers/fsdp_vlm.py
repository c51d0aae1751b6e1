"""Tiny random vision-language model directories (model, tokenizer, processor, chat template)
and drawn-image conversation files for the ``anyspeed fsdp2`` tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]  # fmt: skip
# A ChatML template that places each image item where the message has it (written for these
# tests; the released models' templates do the same for images).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer(tok_dir: str) -> Any:
    """The tests' byte-level BPE with the Qwen-VL special tokens added."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(tok_dir) / "tokenizer.json"))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL, "pad_token": "<|im_end|>"})
    tok.eos_token = "<|im_end|>"
    return tok


def _text(tok: Any, **extra: Any) -> dict[str, Any]:
    """A 2-layer text model (hidden 64, mRoPE sections 2/3/3) over ``tok``'s vocabulary."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    rope.update(extra.pop("rope", {}))
    return dict(
        vocab_size=len(tok) + 8,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters=rope,
        **extra,
    )


def _save(
    directory: str | Path, tok: Any, family: tuple[Any, Any], sizes: dict, seed: int, image: Any
) -> str:
    """Save a random model of ``family`` (config class, model class) built from ``sizes``
    (text_config, vision_config), with ``tok``'s special-token ids, the chat template and the
    image processor ``image``."""
    config_cls, model_cls = family
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    config = config_cls(
        **sizes,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(str(directory))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(directory))
    image.save_pretrained(str(directory))
    return str(directory)


def _image_processor(**kw: Any) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(**kw)


def qwen25_vl(directory: str | Path, tok_dir: str, seed: int = 0) -> str:
    """A random tiny Qwen2.5-VL (2 text layers, a 2-block tower with one full-attention block)
    and its processor at ``directory``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = tokenizer(tok_dir)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, fullatt_block_indexes=[1], window_size=56)  # fmt: skip
    sizes = {"text_config": _text(tok), "vision_config": vision}
    image = _image_processor(min_pixels=56 * 56, max_pixels=112 * 112)
    family = (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)
    return _save(directory, tok, family, sizes, seed, image)


def qwen3_vl(directory: str | Path, tok_dir: str, seed: int = 0) -> str:
    """A random tiny Qwen3-VL (2 text layers; a 2-block tower with 16-pixel patches, learned
    position embeddings and DeepStack features from both blocks) and its image processor."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = tokenizer(tok_dir)
    text = _text(tok, head_dim=16, rope={"mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=16, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1])  # fmt: skip
    image = _image_processor(patch_size=16, merge_size=2, min_pixels=64**2, max_pixels=128**2)
    family = (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    return _save(
        directory, tok, family, {"text_config": text, "vision_config": vision}, seed, image
    )


def draw(path: str | Path, shape: str, size: tuple[int, int], seed: int) -> str:
    """A PNG of one coloured square or disc on a plain ground."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    im = Image.new("RGB", size, tuple(int(c) for c in rng.integers(0, 255, 3)))
    d = ImageDraw.Draw(im)
    box = (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4)
    fill = tuple(int(c) for c in rng.integers(0, 255, 3))
    (d.ellipse if shape == "disc" else d.rectangle)(box, fill=fill)
    im.save(path)
    return str(path)


def conversations(folder: str | Path, n: int = 8) -> str:
    """``n`` records in the LLaMA-Factory / MindSpeed-MM ``mllm`` layout: images of two sizes
    (one record with two images, one without any) and the shape as the answer."""
    folder = Path(folder)
    records = []
    for i in range(n):
        shape = ("disc", "square")[i % 2]
        size = ((56, 84), (112, 56))[i % 2]
        img = draw(folder / f"img{i}.png", shape, size, i)
        record = {
            "messages": [
                {"role": "user", "content": "<image>What shape is drawn?"},
                {"role": "assistant", "content": f"A {shape}."},
            ],
            "images": [Path(img).name],
        }
        if i == 3:  # two images in one record
            record["messages"][0]["content"] = "<image><image>Which shapes?"
            record["images"].append(Path(draw(folder / "extra.png", "disc", (84, 84), 99)).name)
        if i == 5:  # a text-only record
            record = {"messages": [{"role": "user", "content": "Say hello."},
                                   {"role": "assistant", "content": "Hello."}]}  # fmt: skip
        records.append(record)
    path = folder / "data.json"
    path.write_text(json.dumps(records))
    return str(path)
