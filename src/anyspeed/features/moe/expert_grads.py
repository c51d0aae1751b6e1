"""Expert gradients at expert TP < TP without expert parallelism (Megatron-Core 0.16.1).

Megatron marks an expert linear's parameters for its expert-data-parallel reduction
(``allreduce = False``) only when ``--expert-model-parallel-size`` > 1. With EP 1 and expert TP
below TP (``--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1``: what experts with
biases require), each TP rank's experts see only that rank's sequence-parallel tokens, but their
gradients go to the dense buffers, reduced over the data-parallel group, which holds one TP rank:
the ranks' partial expert gradients are never summed (``anyspeed verify`` names them; the loss
parts from one process at the second step). Expert parameters are always marked for the
expert-data-parallel group here (with EP 1 and expert TP = TP that group is the data-parallel
group: nothing changes), and an expert bias is not also marked sequence-parallel (it would be
summed over TP a second time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def expert_reduction(init: Callable[..., Any]) -> Callable[..., Any]:
    """A parallel linear's ``__init__`` that marks an expert's parameters as expert-parallel."""

    def parallel_linear_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if not getattr(self, "is_expert", False):
            return
        for name in ("weight", "bias"):
            p = getattr(self, name, None)
            if isinstance(p, torch.nn.Parameter):
                p.allreduce = False
        if getattr(self, "bias", None) is not None:
            self.bias.sequence_parallel = False

    parallel_linear_init.__wrapped__ = init  # type: ignore[attr-defined]
    return parallel_linear_init
