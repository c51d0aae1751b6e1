"""Expert gradients at expert TP < TP without expert parallelism (Megatron-Core 0.16.1).

Megatron marks an expert linear's parameters for its expert-data-parallel reduction
(``allreduce = False``) only when ``--expert-model-parallel-size`` > 1. With EP 1 and expert TP
below TP (``--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1``: what experts with
biases require), each TP rank's experts see only that rank's sequence-parallel tokens, but their
gradients go to the dense buffers, reduced over the data-parallel group, which holds one TP rank:
the ranks' partial expert gradients are never summed (``anyspeed verify`` names them; the loss
parts from one process at the second step). In exactly that case (EP 1, expert TP < TP) expert
parameters are marked for the expert-data-parallel group here; and whenever expert TP < TP an
expert bias is not also marked sequence-parallel (the expert-data-parallel reduction already
sums it over the TP ranks; the mark summed it a second time). With EP > 1 as well, the TP ranks
hold different experts, but Megatron counts an unsplit parameter (the fc2 bias) in the grad norm
on TP rank 0 only (5.5e-3 low at EP2 x TP2, so clipping differed): the bias is marked
tensor-parallel, counted on every rank. Other layouts keep Megatron's marks (and their
optimizer and checkpoint structure).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def expert_reduction(init: Callable[..., Any]) -> Callable[..., Any]:
    """A parallel linear's ``__init__`` that marks an expert's parameters as expert-parallel."""

    def parallel_linear_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        cfg = getattr(self, "config", None)
        if not getattr(self, "is_expert", False) or cfg is None:
            return
        etp = cfg.expert_tensor_parallel_size or cfg.tensor_model_parallel_size
        if etp >= cfg.tensor_model_parallel_size:
            return  # Megatron's own marks are right here
        if cfg.expert_model_parallel_size == 1:  # with EP > 1 Megatron marks them itself
            for name in ("weight", "bias"):
                p = getattr(self, name, None)
                if isinstance(p, torch.nn.Parameter):
                    p.allreduce = False
        if getattr(self, "bias", None) is not None:
            self.bias.sequence_parallel = False
            if cfg.expert_model_parallel_size > 1:
                # the TP ranks hold different experts: each one's bias counts in the grad norm
                # (Megatron counts an unsplit parameter on TP rank 0 only)
                self.bias.tensor_model_parallel = True
                self.bias.partition_dim, self.bias.partition_stride = 0, 1

    parallel_linear_init.__wrapped__ = init  # type: ignore[attr-defined]
    return parallel_linear_init
