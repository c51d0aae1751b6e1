"""Device-generic pieces of Megatron's MoE token dispatch."""

from __future__ import annotations

from typing import Any

import torch


def splits_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Megatron's ``maybe_move_tensor_to_cpu`` for every device: a tensor on any device comes
    to the host (as numpy when asked, as the alltoall's split sizes must be); no side stream."""
    if not torch.is_tensor(tensor):
        return tensor
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.numpy() if as_numpy else tensor
