"""A scalar reward head in place of the language-model output layer: the outcome reward model
(``--stage orm``), exported as transformers' ``*ForSequenceClassification`` with one label.

The head is one ``hidden -> 1`` linear (``score``, no bias, as transformers'), replicated on the
tensor-parallel ranks: under sequence parallelism the hidden states are gathered first (whose
backward only splits, since every rank computes the same score). The checkpoint key is
``output_layer.score.weight``.
"""

from __future__ import annotations

import types
from typing import Any

import torch

HEAD_KEY = "output_layer.score.weight"
INIT_SEED = 1234


class RewardHead(torch.nn.Module):
    """Called as Megatron's output layer: ``(hidden [s, b, h]) -> (scores [s, b, 1], None)``."""

    def __init__(self, hidden_size: int, init_std: float, sequence_parallel: bool) -> None:
        super().__init__()
        self.score = torch.nn.Linear(hidden_size, 1, bias=False)
        with torch.no_grad():  # the same on every rank (it is replicated), whatever drew before
            gen = torch.Generator().manual_seed(INIT_SEED)
            self.score.weight.normal_(0.0, init_std, generator=gen)
        self.sequence_parallel = sequence_parallel

    def forward(
        self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return self.score(hidden.to(self.score.weight.dtype)), None


def reward_head(chunk: torch.nn.Module, model: Any) -> torch.nn.Module:
    """Model transform: the last chunk's output layer becomes a :class:`RewardHead`; no chunk
    shares its embedding with an output layer any more (the first stage keeps its own)."""
    core = chunk
    while not hasattr(core, "post_process") and hasattr(core, "module"):
        core = core.module
    core.share_embeddings_and_output_weights = False
    if core.post_process:
        cfg = core.config
        core.output_layer = RewardHead(cfg.hidden_size, cfg.init_method_std, cfg.sequence_parallel)
        core.sharded_state_dict = types.MethodType(_state_with_head, core)
    return chunk


def _state_with_head(
    core: Any, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
) -> dict:
    """The model's sharded state dict with the head's own entry: Megatron's language model
    would treat ``output_layer.weight`` as a vocabulary projection (padding, tying), so its
    output-layer handling is skipped while the dict is built."""
    core.post_process = False
    try:
        return type(core).sharded_state_dict(core, prefix, sharded_offsets, metadata)
    finally:
        core.post_process = True
