"""Qwen-VL material made on the machine: a word-level tokenizer with Qwen's chat and vision
tokens, a tiny random ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
directory (with its image processor's settings) and drawn-shape conversations in the ``mllm``
layout, at two image sizes. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import random

from anyspeed.demo import mm_data

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<unk>",
]
WORDS = ["system", "user", "assistant", "You", "are", "helpful", ".", *mm_data.WORDS[2:]]
VOCAB = 64
QUESTION = "<image>what is in the picture?"
SIZES = ((32, 32), (24, 32))  # (height, width) of the drawn images, alternating
MAX_PIXELS = 16 * 16  # the processor's bound: a 32 x 32 image becomes 16 x 16 pixels


def token_ids() -> dict[str, int]:
    return {t: i for i, t in enumerate([*SPECIAL, *WORDS])}


def make_tokenizer(directory: str) -> None:
    """A word-level tokenizer of the demo's words; Qwen's special tokens are added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(token_ids(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)


def hf_config(kind: str, layers: int = 2, width: int = 64):
    """A tiny config of ``kind`` (``qwen2_vl`` / ``qwen2_5_vl``): patch 2, merge 2, mRoPE
    section [2, 3, 3] over head dim 16; Qwen2.5-VL with 8-pixel windows and layer 1 full."""
    import transformers as T

    ids = token_ids()
    text = dict(
        vocab_size=VOCAB,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=width // 16,
        num_key_value_heads=width // 32,
        intermediate_size=2 * width,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
    )
    if kind == "qwen2_vl":
        vision = dict(embed_dim=32, depth=2, num_heads=4, patch_size=2, hidden_size=width)
        cfg = T.Qwen2VLConfig(text_config=text, vision_config=vision)
    else:
        vision = dict(
            hidden_size=32,
            depth=2,
            num_heads=4,
            patch_size=2,
            intermediate_size=48,
            out_hidden_size=width,
            window_size=8,
            fullatt_block_indexes=[1],
            tokens_per_second=4,
        )
        cfg = T.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    cfg.image_token_id, cfg.video_token_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
    cfg.vision_start_token_id, cfg.vision_end_token_id = (
        ids["<|vision_start|>"],
        ids["<|vision_end|>"],
    )
    return cfg


def make_model(
    directory: str, kind: str = "qwen2_5_vl", seed: int = 0, jitter: float = 0.02, **kw
) -> str:
    """A random tiny Qwen-VL HF directory: weights (jittered by ``jitter``: no constant
    tensor; a large one gives peaked, varied logits), tokenizer and ``preprocessor_config.json``."""
    import torch
    import transformers as T

    torch.manual_seed(seed)
    T.utils.logging.disable_progress_bar()
    cls = (
        T.Qwen2VLForConditionalGeneration
        if kind == "qwen2_vl"
        else T.Qwen2_5_VLForConditionalGeneration
    )
    model = cls(hf_config(kind, **kw))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * jitter)
    model.save_pretrained(directory)
    make_tokenizer(directory)
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "patch_size": 2,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "min_pixels": 16,
                "max_pixels": MAX_PIXELS,
            },
            f,
        )
    return directory


def make_records(folder: str, n: int, seed: int, name: str) -> str:
    """``n`` drawn images (two sizes) under ``folder`` and ``name``.json: their caption
    conversations in the mllm layout."""
    from PIL import Image

    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    records = []
    for i in range(n):
        what = (
            rng.choice(list(mm_data.COLOURS)),
            rng.choice(mm_data.SHAPES),
            rng.choice(mm_data.SIDES),
        )
        image = os.path.join("images", f"{name}_{i:05d}.png")
        path = os.path.join(folder, image)
        mm_data.draw(path, *what, rng)
        h, w = SIZES[i % len(SIZES)]
        if (h, w) != (mm_data.IMAGE_SIZE, mm_data.IMAGE_SIZE):
            with Image.open(path) as im:
                im.resize((w, h)).save(path)
        messages = [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": mm_data.caption(*what)},
        ]
        records.append({"messages": messages, "images": [image]})
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records, f)
    return path
