"""Captioning / answering with a LLaVA model: greedy decoding from images and a prompt
(``anyspeed generate --image`` runs it on any checkpoint, :mod:`anyspeed.commands.image`).

Decoding recomputes the whole sequence per new token (no KV cache yet: Megatron's LLaVAModel
keeps its image embeddings in the inference context, which anyspeed's decoder does not drive).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy(
    model: torch.nn.Module,
    images: torch.Tensor,
    prompt: list[int],
    new_tokens: int,
    vocab_size: int,
    end_ids: tuple[int, ...] = (),
    use_kv_cache: bool = True,
) -> list[list[int]]:
    """Per image (one image per row, the same ``prompt``, which holds the image token once),
    the greedy continuation, stopping at an end id. With the KV cache the prompt and image run
    once (Megatron's static inference context), then one token per step."""
    b = images.shape[0]
    ids = torch.tensor([prompt] * b)
    ctx = None
    if use_kv_cache:
        from megatron.core.inference.contexts import StaticInferenceContext

        n_img = model.img_seq_len  # positions the image token becomes
        ctx = StaticInferenceContext(b, len(prompt) - 1 + n_img + new_tokens)
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    step_ids = ids
    for _ in range(new_tokens):
        logits, _ = model(
            images, step_ids, None, None, inference_context=ctx, runtime_gather_output=True
        )
        if ctx is not None:  # past the prompt (its image expanded), then one more per step
            first = ctx.sequence_len_offset == 0
            ctx.sequence_len_offset += len(prompt) - 1 + n_img if first else 1
            ctx.enable_decode_mode()
        nxt = logits[:, -1, :vocab_size].argmax(-1)
        for i in range(b):
            if not done[i]:
                out[i].append(int(nxt[i]))
        done |= torch.isin(nxt, torch.tensor(end_ids or (-1,)))
        if bool(done.all()):
            break
        ids = torch.cat([ids, nxt[:, None]], 1)
        step_ids = nxt[:, None] if ctx is not None else ids
    return [[t for t in row if t not in end_ids] for row in out]
