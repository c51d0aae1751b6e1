"""Generation with a Qwen2-VL / Qwen2.5-VL model: the prompt with its images and videos runs
once through Megatron's static KV cache, then one token per step at mRoPE position
``real tokens so far + rope delta`` on all three axes (transformers' decoding rule: left padding
does not count).

Megatron caches keys before their rotation and turns the whole cache at every step, so each
step passes the positions of every token so far.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from anyspeed.models.qwen_vl.positions import mrope_positions


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    vision: dict[str, torch.Tensor],
    new_tokens: int,
    vocab_size: int,
    end_ids: tuple[int, ...] = (),
    pick: Callable[[torch.Tensor], torch.Tensor] | None = None,
    use_kv_cache: bool = True,
    pad: torch.Tensor | None = None,
) -> list[list[int]]:
    """Per row of ``input_ids`` [b, n] the continuation of at most ``new_tokens``, stopping
    at an end id; rows may be left-padded by ``pad`` [b] tokens (hidden from attention, at
    position 0, as transformers places them). ``vision`` holds the pixel rows and grids
    (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
    ``second_per_grid_ts``) of all rows in order; ``pick`` maps last logits [b, vocab] to
    tokens (default greedy). Without the KV cache every step runs the whole sequence. Under
    pipeline parallelism ``model`` is this stage's chunk; every stage returns the tokens."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from anyspeed.inference.stepper import Batch

    inner: Any = getattr(model, "module", model)
    b, n = input_ids.shape
    batch = Batch(input_ids.cpu(), torch.zeros(b, dtype=torch.int64) if pad is None else pad.cpu())
    real = torch.arange(n)[None, :] >= batch.pad[:, None]
    positions, deltas = mrope_positions(
        input_ids.cpu(),
        inner.tokens,
        _cpu(vision.get("image_grid_thw")),
        _cpu(vision.get("video_grid_thw")),
        _cpu(vision.get("second_per_grid_ts")),
        attention_mask=real.long(),
    )
    positions, deltas = positions.to(input_ids.device), deltas.to(input_ids.device)
    ctx = StaticInferenceContext(b, n + new_tokens) if use_kv_cache else None
    step, inputs, seq = input_ids, dict(vision), input_ids
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
    ends = torch.tensor(end_ids or (-1,), device=input_ids.device)
    for k in range(new_tokens):
        end = n + k
        start = end - step.shape[1]
        mask = batch.mask(start, end)
        mask = None if mask is None else mask.to(input_ids.device)
        kw = dict(
            position_ids=positions,
            attention_mask=mask,
            inference_context=ctx,
            runtime_gather_output=True,
            **inputs,
        )
        nxt = _next(model, step, kw, pick or _greedy, vocab_size)
        if ctx is not None:
            ctx.sequence_len_offset += step.shape[1]
            ctx.enable_decode_mode()
        for i in range(b):
            if not done[i]:
                out[i].append(int(nxt[i]))
        done |= torch.isin(nxt, ends)
        if bool(done.all()):
            break
        real_so_far = (n + k - batch.pad).to(deltas.device)  # transformers counts real tokens
        nxt_pos = (real_so_far[:, None] + deltas).view(1, b, 1).expand(3, b, 1)
        positions = torch.cat([positions, nxt_pos.to(positions.dtype)], dim=2)
        seq = torch.cat([seq, nxt[:, None]], 1)
        step, inputs = (nxt[:, None], {}) if ctx is not None else (seq, inputs)
    return [[t for t in row if t not in end_ids] for row in out]


def _next(
    model: Any, step: torch.Tensor, kw: dict, pick: Callable, vocab_size: int
) -> torch.Tensor:
    """The next token of each row: the model called directly, or (a pipeline stage's chunk)
    through Megatron's forward-only schedule, the last stage's pick shared with every stage."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return pick(model(step, **kw)[:, -1, :vocab_size].float())
    from anyspeed.inference.forward import scheduled
    from anyspeed.inference.stepper import share

    logits = scheduled([model], step, lambda chunk: chunk(step, **kw))
    nxt = torch.zeros(step.shape[0], dtype=torch.long)
    if logits is not None:
        nxt = pick(logits[:, -1, :vocab_size].float()).long().cpu()
    return share(nxt).to(step.device)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()
