"""A forward-only pass through the pipeline schedule that returns each micro-batch's labels'
log-probabilities (the reference / old-policy pass of preference and RL stages)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from anyspeed.distributed import pipeline


def logprob_pass(
    trainer: Any,
    chunks: list[torch.nn.Module],
    microbatches: list[dict],
    vocab_size: int | None = None,
    temperature: float = 1.0,
) -> list[torch.Tensor] | None:
    """[b, s] log-probabilities per micro-batch on the last pipeline stage (None elsewhere),
    through :func:`anyspeed.models.logprobs.token_logprobs` (vocab-parallel, any TP/PP/CP)."""
    from anyspeed.models.logprobs import token_logprobs
    from anyspeed.training.model_pipeline import unwrap
    from anyspeed.training.packed_rows import model_inputs, to_rows

    def compute(model: torch.nn.Module, b: dict) -> torch.Tensor:
        tokens, pos, labels, packed = model_inputs(b)
        out = token_logprobs(
            model, tokens, pos, labels, b.get("attention_mask"), packed, vocab_size, temperature
        )
        return to_rows(out, b) if unwrap(model).post_process else out

    return output_pass(trainer, chunks, microbatches, compute)


def output_pass(
    trainer: Any,
    chunks: list[torch.nn.Module],
    microbatches: list[dict],
    compute: Callable[[torch.nn.Module, dict], torch.Tensor],
) -> list[torch.Tensor] | None:
    """``compute(model, micro_batch)`` of each micro-batch through the pipeline schedule,
    forward only: its outputs on the last pipeline stage (None elsewhere); e.g. a critic's
    per-token values."""
    from megatron.core import parallel_state as ps

    def forward_step(data_iterator, model):
        out = compute(model, next(data_iterator))

        def collect(output_tensor, non_loss_data=True):
            return output_tensor.clone()

        # Detached here: under autograd (``exact``) an output that leaves with its graph keeps
        # its micro-batch's activations alive in the schedule (measured: every micro-batch's
        # at once, tests/training/test_logprob_pass_memory.py).
        return out.detach(), collect

    from anyspeed.training.packed_rows import is_packed, schedule_shape

    rows = [int(b["tokens"].shape[0]) for b in microbatches]
    seq, mbs = schedule_shape(trainer.task, trainer.cfg, microbatches)
    if ps.get_pipeline_model_parallel_world_size() > 1:  # (a packed one is one sequence)
        full = trainer.cfg.micro_batch_size
        microbatches = [b if is_packed(b) else _filled(b, full) for b in microbatches]
    data = [iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches)
    out = pipeline.forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq,
        micro_batch_size=mbs,
        forward_only=True,
        collect_non_loss_data=True,
    )
    if not pipeline.is_output_stage():
        return None
    return [o[:n] for o, n in zip(out, rows, strict=True)]


def _filled(b: dict, mbs: int) -> dict:
    """A micro-batch of fewer rows than ``mbs`` filled up with copies of its last row: the
    pipeline's stages exchange tensors of ``mbs`` rows (a short one was read misaligned)."""
    n = int(b["tokens"].shape[0])
    if n >= mbs:
        return b

    def fill(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != n:
            return v
        return torch.cat([v, v[-1:].expand(mbs - n, *v.shape[1:])])

    return {k: fill(v) for k, v in b.items()}


def row_values(
    trainer: Any,
    chunks: list[torch.nn.Module],
    microbatches: list[dict],
    compute: Callable[[torch.nn.Module, dict], torch.Tensor],
    tail: tuple[int, ...] = (),
) -> torch.Tensor:
    """:func:`output_pass` of a ``compute`` that gives one value (or a ``tail``-shaped tensor)
    per row (a score): every micro-batch's rows in order [n, *tail], fp64 on the host, on every
    pipeline stage (the last stage's, broadcast)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = output_pass(trainer, chunks, microbatches, compute)
    n = sum(int(b["tokens"].shape[0]) for b in microbatches)
    device = microbatches[0]["tokens"].device
    got = torch.cat(out) if out is not None else torch.zeros((n, *tail), device=device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            got,
            src=pipeline.output_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
    return got.double().cpu()
