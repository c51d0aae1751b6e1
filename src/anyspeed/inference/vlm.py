"""Captioning / answering with a trained LLaVA checkpoint: load it (one process, any layout it
was trained at) and decode greedily from images and a prompt.

Decoding recomputes the whole sequence per new token (no KV cache yet: Megatron's LLaVAModel
keeps its image embeddings in the inference context, which anyspeed's decoder does not drive).
"""

from __future__ import annotations

import json
from typing import Any

import torch


def llava_of(ckpt: str) -> Any:
    """The :class:`LlavaConfig` a ``vlm`` checkpoint records (language model included)."""
    from anyspeed.checkpoint.reads import read_common, tracked_dir
    from anyspeed.checkpoint.record import model_in_common
    from anyspeed.models.vision import LlavaConfig, VisionConfig
    from anyspeed.training.tasks.vlm import RECORD

    path = tracked_dir(ckpt)
    common = read_common(path) if path else {}
    if RECORD not in common:
        raise ValueError(f"{ckpt}: not a checkpoint of anyspeed posttrain --stage vlm")
    rec = json.loads(common[RECORD])
    vision = VisionConfig(**rec.pop("vision"))
    lm = model_in_common(common, ckpt, as_hf=False)
    return LlavaConfig(language=lm, vision=vision, **rec)


def load_llava(ckpt: str) -> tuple[torch.nn.Module, Any]:
    """The checkpoint's LLaVA model (TP1, eval) and config; Megatron's parallel state (one
    rank) must be initialised (:func:`anyspeed.convert.megatron_io.megatron_session`)."""
    from anyspeed.checkpoint.save_load import load_weights
    from anyspeed.models import gpt, multimodal

    cfg = llava_of(ckpt)
    config = gpt.transformer_config(cfg.language, perform_initialization=False)
    model = multimodal.build_llava(cfg, config)
    load_weights(ckpt, [model])
    return model.eval(), cfg


@torch.no_grad()
def greedy(model: torch.nn.Module, images: torch.Tensor, prompt: list[int], new_tokens: int,
           vocab_size: int, end_ids: tuple[int, ...] = ()) -> list[list[int]]:  # fmt: skip
    """Per image (one image per row, the same ``prompt``, which holds the image token), the
    greedy continuation (stopping at an end id)."""
    b = images.shape[0]
    ids = torch.tensor([prompt] * b)
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    for _ in range(new_tokens):
        logits, _ = model(images, ids, None, None)
        nxt = logits[:, -1, :vocab_size].argmax(-1)
        for i in range(b):
            if not done[i]:
                out[i].append(int(nxt[i]))
        done |= torch.isin(nxt, torch.tensor(end_ids or (-1,)))
        if bool(done.all()):
            break
        ids = torch.cat([ids, nxt[:, None]], 1)
    return [[t for t in row if t not in end_ids] for row in out]
