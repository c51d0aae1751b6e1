"""Captioning / answering with a LLaVA model: greedy decoding from images and a prompt
(:mod:`anyspeed.commands.vlm_session` loads a trained checkpoint).

Decoding recomputes the whole sequence per new token (no KV cache yet: Megatron's LLaVAModel
keeps its image embeddings in the inference context, which anyspeed's decoder does not drive).
"""

from __future__ import annotations

import torch


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
