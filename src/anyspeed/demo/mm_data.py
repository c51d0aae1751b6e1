"""The multimodal demo's material, made on the machine: shape images drawn with pillow, captions
from what was drawn (LLaVA's conversation jsonl), a word-level tokenizer and a tiny random
Hugging Face LLaVA (CLIP tower) to start from. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import random

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 80, 230),
    "yellow": (230, 220, 40),
    "white": (240, 240, 240),
}
SHAPES = ("circle", "square", "triangle")
SIDES = ("left", "right")
QUESTION = "<image>\nwhat is in the picture?"
IMAGE_SIZE = 32
WORDS = [
    "USER",
    "ASSISTANT",
    ":",
    "what",
    "is",
    "in",
    "the",
    "picture",
    "?",
    "a",
    "on",
    *COLOURS,
    *SHAPES,
    *SIDES,
]
SPECIAL = ["<pad>", "</s>", "<unk>"]
VOCAB = 64  # the language model's rows; the image token is the last
IMAGE_TOKEN = VOCAB - 1


def caption(colour: str, shape: str, side: str) -> str:
    return f"a {colour} {shape} on the {side}"


def draw(path: str, colour: str, shape: str, side: str, rng: random.Random) -> None:
    """A 32x32 PNG: one shape of ``colour`` in the ``side`` half, jittered, on a dark ground."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (rng.randint(0, 30),) * 3)
    d = ImageDraw.Draw(im)
    r = rng.randint(5, 7)
    cx = (8 if side == "left" else 24) + rng.randint(-2, 2)
    cy = 16 + rng.randint(-6, 6)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    im.save(path)


def make_records(folder: str, n: int, seed: int, name: str) -> str:
    """``n`` drawn images under ``folder`` and ``name``.jsonl of their caption conversations."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    path = os.path.join(folder, f"{name}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            what = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(SIDES)
            image = os.path.join("images", f"{name}_{i:05d}.png")
            draw(os.path.join(folder, image), *what, rng)
            conv = [{"from": "human", "value": QUESTION}, {"from": "gpt", "value": caption(*what)}]
            f.write(json.dumps({"id": f"{name}{i}", "image": image, "conversations": conv}) + "\n")
    return path


def make_tokenizer(directory: str) -> None:
    """A word-level tokenizer of the demo's words (a standard HF tokenizer directory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*SPECIAL, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)


def make_model(directory: str, seed: int = 0, kind: str = "clip") -> str:
    """A random tiny ``LlavaForConditionalGeneration`` (LLaMA 2 layers/128, a 2-layer tower
    over 8x8 patches) and the demo's tokenizer, saved as an HF directory."""
    import torch
    import transformers as T

    vision = dict(
        model_type=f"{kind}_vision_model",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=8,
    )
    text = dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    strategy = "default" if kind == "clip" else "full"
    cfg = T.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1,
        vision_feature_select_strategy=strategy,
    )
    torch.manual_seed(seed)
    T.utils.logging.disable_progress_bar()  # one tiny file: no "Writing model shards" bar
    T.LlavaForConditionalGeneration(cfg).save_pretrained(directory)
    make_tokenizer(directory)
    return directory
