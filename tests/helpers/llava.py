"""Tiny random Hugging Face LLaVA models (CLIP or SigLIP tower) and their inputs, for the
multimodal tests: built from transformers' configs, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, IMAGE_TOKEN = 256, 255


def hf_config(kind: str = "clip", layers: int = 3, **changes):
    """A LlavaConfig: LLaMA 2 layers/64, tower ``layers``/32 on 32x32 images in 8x8 patches
    (the penultimate layer's output feeds the projector, as in LLaVA-1.5)."""
    import transformers as T

    vision = dict(model_type=f"{kind}_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, image_size=32,
                  patch_size=8)  # fmt: skip
    text = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                rms_norm_eps=1e-5)  # fmt: skip
    strategy = "default" if kind == "clip" else "full"
    kw = dict(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
              vision_feature_select_strategy=strategy, vision_feature_layer=-2)  # fmt: skip
    kw.update(changes)
    return T.LlavaConfig(**kw)


def hf_model(kind: str = "clip", seed: int = 0, **changes):
    """A random tiny LlavaForConditionalGeneration (weights jittered so no tensor is a
    constant: norms and biases matter to the comparison)."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.LlavaForConditionalGeneration(hf_config(kind, **changes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def save(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def inputs(image_seq_len: int, batch: int = 2, seed: int = 1):
    """Images, HF input ids (the image token repeated ``image_seq_len`` times, as transformers'
    processor expands it) and Megatron's (one image token per image)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, 32, 32, generator=g)
    text = torch.randint(0, IMAGE_TOKEN - 1, (batch, 10), generator=g)
    one = torch.full((batch, 1), IMAGE_TOKEN)
    hf_ids = torch.cat([text[:, :3], one.expand(batch, image_seq_len), text[:, 3:]], 1)
    mg_ids = torch.cat([text[:, :3], one, text[:, 3:]], 1)
    return images, hf_ids, mg_ids
