"""Continue rows of a decoded batch from its KV cache instead of re-reading their prompts.

A multi-turn rollout samples an answer, appends a tool's response and samples again. The
kept batch's static cache already holds every row's prompt and answer, but at slots that no
longer line up: rows ended at different steps and the batch kept stepping (the slots after a
row's end hold tokens it never chose). The next turn's batch is laid out afresh, left-padded
to its widest row, and each row's still-valid keys and values (the longest prefix its cached
tokens share with its new prompt) are moved to their new slots; only the rest (the end of the
answer the cache had not fed yet, and the tool's tokens) is fed as one block. Attention with
rotary positions depends only on the distance between slots, so a row moved as a whole keeps
its scores; keys the cache stores already rotated (``no-grad-fast-path``) are rotated on by the
shift. Kinds of model whose cache cannot be moved this way (recurrent DeltaNet state, latent
attention, interleaved or scaled rotary, context parallelism) and lock-step decoding return
None, and the caller reads the prompts afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from anyspeed.inference.stepper import Batch, Stepper


def resumed(
    old: Stepper,
    rows: Sequence[int],
    prompts: Sequence[Sequence[int]],
    req: Any,
    budget: Callable[[int, Any], int],
) -> Stepper | None:
    """A stepper for ``prompts`` (prompt ``r`` extends kept row ``rows[r]``) whose cache holds
    what ``old``'s cache already had of each row; None where the cache cannot be moved."""
    ctx = old.context
    if ctx is None or req.lockstep or not extendable(old.model, ctx):
        return None
    if len(rows) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts continue {len(rows)} kept rows")
    end = ctx.sequence_len_offset
    common = []
    for o, p in zip(rows, prompts, strict=True):
        cached = old.seq[o, int(old.batch.pad[o]) : end].tolist()
        common.append(min(_shared(cached, p), len(p) - 1))  # feed at least one token
    batch = replace(Batch.left_padded(prompts, req.pad_id), masked=True)
    width = batch.tokens.shape[1]
    start = width - max(len(p) - c for p, c in zip(prompts, common, strict=True))
    if start <= 0:
        return None
    new = Stepper(old.model, batch, width + budget(width, req), True, old.vocab)
    table = _rotation_table(old.model, ctx, width + int(old.batch.pad.max()))
    moves = [
        (o, int(old.batch.pad[o]), int(batch.pad[r]), start - int(batch.pad[r]))
        for r, o in enumerate(rows)
    ]
    for layer, (keys, values) in ctx.key_value_memory_dict.items():
        nk, nv = (
            _zeros_like_order(t, (new.total, len(rows), *t.shape[2:])) for t in (keys, values)
        )
        for r, (o, was, now, keep) in enumerate(moves):
            if keep <= 0:
                continue
            nk[now:start, r] = _rotate(keys[was : was + keep, o], now - was, table)
            nv[now:start, r] = values[was : was + keep, o]
        new.context.key_value_memory_dict[layer] = (nk, nv)
    new.context.sequence_len_offset = start
    if table is not None:  # the moved keys are rotated: say so for the turn after this one
        from anyspeed.features.inference.feature import KEYS_ROTATED

        setattr(new.context, KEYS_ROTATED, True)
    return new


def extendable(model: list[torch.nn.Module], ctx: Any) -> bool:
    """Whether ``model``'s static cache in ``ctx`` can be moved between slots exactly."""
    from megatron.core.transformer import attention

    from anyspeed.features.inference.delta_net_state import STATES

    if getattr(ctx, STATES, None):  # a recurrent state has no slots to move
        return False
    for chunk in model:
        config = getattr(chunk, "config", None)
        kind = getattr(chunk, "position_embedding_type", None)
        if config is None or not hasattr(chunk, "decoder"):
            return False
        if kind not in ("rope", "learned_absolute", "none"):
            return False
        if config.multi_latent_attention or config.flash_decode:
            return False
        if config.context_parallel_size != 1 or config.experimental_attention_variant:
            return False
        scaled = attention._yarn_get_concentration_factor_from_config(config) != 1.0
        if kind == "rope" and (config.rotary_interleaved or scaled):
            return False
    return True


def _rotation_table(model: list[torch.nn.Module], ctx: Any, n: int) -> torch.Tensor | None:
    """The model's rotary angles [n, 1, 1, rot] when the cache holds keys already rotated
    to their slots (None when keys are stored as computed: moving them is enough)."""
    from anyspeed.features.inference.feature import KEYS_ROTATED

    if not getattr(ctx, KEYS_ROTATED, False):
        return None
    for chunk in model:
        rope = getattr(chunk, "rotary_pos_emb", None)
        if rope is not None and chunk.position_embedding_type == "rope":
            return rope(n)
    return None


def _rotate(keys: torch.Tensor, shift: int, table: torch.Tensor | None) -> torch.Tensor:
    """Keys [k, groups, dim] rotated on by ``shift`` slots (as stored when ``table`` is None)."""
    if table is None or shift == 0:
        return keys
    from anyspeed.features.ops.rope import apply_rope

    angle = table[abs(shift)].to(keys.device)
    angle = angle if shift > 0 else -angle
    return apply_rope(keys[:, None], angle[None].expand(keys.shape[0], -1, -1, -1))[:, 0]


def _zeros_like_order(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros of ``shape`` [seq, batch, groups, dim] in ``t``'s memory order: the lean decode
    step's cache is laid out [batch, groups, seq, dim] (``decode_step.allocate_cache``)."""
    if t.dim() == 4 and t.permute(1, 2, 0, 3).is_contiguous() and not t.is_contiguous():
        return t.new_zeros(shape[1], shape[2], shape[0], shape[3]).permute(2, 0, 1, 3)
    return t.new_zeros(shape)


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
