"""Full-vocabulary logits of token ids through the pipeline schedule, at any layout."""

from __future__ import annotations

import torch


@torch.no_grad()
def forward_logits(model: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits [b, s, vocab] of ``tokens`` through ``model``'s chunks (gathered across TP),
    causal attention, on the CPU.

    Returned on the last pipeline stage; None on the other stages.
    """
    from anyspeed.inference.forward import pipeline_forward

    out = pipeline_forward(model, tokens)
    return None if out is None else out.cpu()
