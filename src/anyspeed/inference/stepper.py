"""A batch of left-padded prompts and the stepper that feeds it through the model, with or
without Megatron's static KV cache (shared by sampling, beam search and resumed turns)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from anyspeed.distributed import pipeline
from anyspeed.models.longrope import reencodes


@dataclass
class Batch:
    """Left-padded prompts: ``tokens`` [b, s], ``pad`` [b] pad count of each row."""

    tokens: torch.Tensor
    pad: torch.Tensor
    # mask even without padding: a block of several tokens fed after cached ones (Megatron
    # masks nothing past the first forward of a static cache unless given a mask)
    masked: bool = False

    @classmethod
    def left_padded(
        cls, prompts: Sequence[Sequence[int]], pad_id: int, width: int | None = None
    ) -> Batch:
        """One row per prompt, padded on the left with ``pad_id`` (to ``width`` if wider)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        width = max([len(p) for p in prompts] + [width or 0])
        rows = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
        pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.int64)
        return cls(torch.tensor(rows, dtype=torch.int64), pad)

    @property
    def padded(self) -> bool:
        return self.masked or bool(self.pad.any())

    def positions(self, start: int, end: int) -> torch.Tensor:
        """Real positions [b, end - start] of slots start..end (padding slots at 0)."""
        slots = torch.arange(start, end).expand(len(self.pad), -1)
        return (slots - self.pad[:, None]).clamp(min=0)

    def mask(self, start: int, end: int) -> torch.Tensor | None:
        """Megatron mask [b, 1, end - start, end] for queries at slots start..end: causal,
        padding hidden (a padding slot sees itself, so no row is empty). None when unpadded."""
        if not self.padded:
            return None
        q = torch.arange(start, end)[:, None]
        k = torch.arange(end)[None, :]
        is_pad = k[None] < self.pad[:, None, None]
        hidden = (k > q)[None] | (is_pad & (k != q)[None])
        return hidden[:, None]


def share(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the last pipeline stage holds it, on every rank of its pipeline group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return t
    from anyspeed.device import torch_device

    buf = t.to(torch_device())
    dist.broadcast(
        buf,
        src=pipeline.output_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    return buf.cpu()


class Stepper:
    """Feeds a batch through the model step by step, with or without the KV cache."""

    def __init__(
        self,
        model: list[torch.nn.Module],
        batch: Batch,
        total: int,
        use_kv_cache: bool,
        vocab_size: int | None = None,
    ) -> None:
        self.model, self.batch, self.vocab, self.total = model, batch, vocab_size, total
        self.seq = batch.tokens.clone()
        self.context = None
        if use_kv_cache:
            from megatron.core.inference.contexts import StaticInferenceContext

            self.context = StaticInferenceContext(len(batch.pad), total)

    def logits(self) -> torch.Tensor | None:
        """Next-token logits [b, vocab] on the last stage (None elsewhere) for ``self.seq``."""
        from anyspeed.inference.forward import pipeline_forward

        end = self.seq.shape[1]
        ctx = self.context
        start = 0 if ctx is None else ctx.sequence_len_offset
        if ctx is not None and reencodes(self.model, start, end):  # LongRoPE's long set
            from megatron.core.inference.contexts import StaticInferenceContext

            self.context = ctx = StaticInferenceContext(len(self.batch.pad), self.total)
            start = 0
        out = pipeline_forward(
            self.model,
            self.seq[:, start:end],
            self.batch.positions(start, end),
            self.batch.mask(start, end),
            ctx,
        )
        if ctx is not None:
            ctx.sequence_len_offset = end
            ctx.enable_decode_mode()
        if out is None:
            return None
        last = out[:, -1].float().cpu()
        return last if self.vocab is None else last[:, : self.vocab]

    def append(self, tokens: torch.Tensor) -> None:
        self.seq = torch.cat([self.seq, tokens[:, None].to(self.seq.dtype)], dim=1)

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows``, in that order (beam search repeats rows; ended rows leave): the
        sequences and the KV cache follow, each cache tensor in its own memory order."""
        self.seq = self.seq[rows]
        self.batch = Batch(self.batch.tokens[rows], self.batch.pad[rows], self.batch.masked)
        if self.context is not None:
            from anyspeed.features.inference.delta_net_state import reorder_states
            from anyspeed.models.dsa import reorder_keys

            kv = self.context.key_value_memory_dict
            for layer, pair in kv.items():
                kv[layer] = tuple(_take_rows(t, rows.to(t.device)) for t in pair)
            reorder_states(self.context, rows)  # a hybrid model's DeltaNet states
            reorder_keys(self.context, rows)  # DeepSeek-V3.2's indexer keys

    def keep_rows(self, rows: list[int]) -> bool:
        """Drop the other rows (ended ones) from the batch and its cache; False, changing
        nothing, without a cache or where it holds anything but [seq, batch, ...] tensors."""
        if self.context is None:
            return False
        n = len(self.batch.pad)
        for pair in self.context.key_value_memory_dict.values():
            if not isinstance(pair, tuple) or not all(
                isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == n for t in pair
            ):
                return False
        self.reorder(torch.tensor(rows, dtype=torch.int64))
        return True


def _take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of a cache tensor [seq, batch, ...] in its memory order (the lean decode
    step lays its cache out batch-major; Megatron's is seq-major)."""
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))  # outermost dim first
    taken = t.permute(order).index_select(order.index(1), rows)  # contiguous in that order
    back = [order.index(i) for i in range(t.dim())]
    return taken.permute(back)
