"""One forward pass of token ids through the pipeline schedule, at any TP/PP layout.

The one place inference runs the model: Megatron's forward-only schedule moves activations
between pipeline stages, the last stage gathers the vocabulary shards across TP. An optional
Megatron ``StaticInferenceContext`` turns it into a KV-cached prefill or decode step.
"""

from __future__ import annotations

from typing import Any

import torch

from anyspeed.distributed import pipeline


@torch.no_grad()
def pipeline_forward(
    model: list[torch.nn.Module],
    tokens: torch.Tensor,
    positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    context: Any = None,
) -> torch.Tensor | None:
    """Logits [b, s, vocab] of ``tokens`` [b, s] (only the last position's with ``context``).

    ``mask`` is Megatron's boolean attention mask [b, 1, s, keys] (True = hidden); None means
    causal. Returned on the last pipeline stage, None on the others.
    """
    from megatron.core import parallel_state as ps

    from anyspeed.device import torch_device

    dev = torch_device()
    tokens = tokens.to(dev)
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=dev).expand(tokens.shape[0], -1)
    positions = positions.to(dev)
    mask = None if mask is None else mask.to(dev)
    kwargs = {"runtime_gather_output": True}  # the output layer gathers the vocab shards
    if context is not None:
        kwargs["inference_context"] = context

    if ps.get_pipeline_model_parallel_world_size() == 1 and len(model) == 1:
        return _direct(model[0], tokens, positions, mask, kwargs)  # no schedule to run
    return scheduled(model, tokens, lambda chunk: chunk(tokens, positions, mask, **kwargs))


@torch.no_grad()
def pipeline_logprobs(
    model: list[torch.nn.Module],
    tokens: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor | None:
    """log p(labels[b, s]) after ``tokens[b, :s+1]`` [b, s] (fp32) through the shared
    log-prob forward (:func:`anyspeed.models.logprobs.token_logprobs`); ``vocab_size``
    excludes the embedding's padded rows. On the last pipeline stage, None elsewhere."""
    from anyspeed.device import torch_device
    from anyspeed.models.logprobs import token_logprobs

    dev = torch_device()
    tokens, labels = tokens.to(dev), labels.to(dev)
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=dev).expand(tokens.shape[0], -1)
    positions, mask = positions.to(dev), None if mask is None else mask.to(dev)

    def call(chunk: torch.nn.Module) -> torch.Tensor:
        return token_logprobs(chunk, tokens, positions, labels, mask, vocab_size=vocab_size)

    return scheduled(model, tokens, call)


def scheduled(model: list[torch.nn.Module], tokens: torch.Tensor, call: Any) -> Any:
    """``call(chunk)`` on every chunk through Megatron's forward-only schedule, in eval mode;
    the last stage's output (None on the other stages)."""

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        out = call(chunk)

        def collect(output_tensor, non_loss_data=True):
            return output_tensor.clone()

        return out, collect

    training = [m for m in model if m.training]  # eval() walks every module: only if needed
    for m in training:
        m.eval()
    n_chunks = len(model)
    data = [iter([0]) for _ in range(n_chunks)] if n_chunks > 1 else iter([0])
    try:
        out = pipeline.forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=model if n_chunks > 1 else model[0],
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=True,
            collect_non_loss_data=True,
        )
    finally:
        for m in training:
            m.train()
    if not pipeline.is_output_stage():
        return None
    return out[0]


def _direct(
    chunk: torch.nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    kwargs: dict,
) -> torch.Tensor:
    """One un-pipelined chunk called directly: the schedule's per-call cost matters when
    decoding one token at a time."""
    training = chunk.training
    if training:
        chunk.eval()
    try:
        return chunk(tokens, positions, mask, **kwargs)
    finally:
        if training:
            chunk.train()
