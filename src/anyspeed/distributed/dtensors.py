"""FSDP2's sharded tensors (DTensors) and the plain local shards checkpoints hold: the shards a
checkpoint loads become DTensors laid out as the parameters (or optimizer state) they belong to.
Shared by anyspeed's checkpoint loading and the adaptor's patch of Megatron's optimizer."""

from __future__ import annotations

from typing import Any

import torch


def as_dtensor(value: Any, like: Any) -> Any:
    """``value`` (a loaded local shard) as a DTensor laid out as ``like`` when ``like`` is one
    (an FSDP2 parameter or optimizer state); else unchanged."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        return value
    return DTensor.from_local(
        value.to(like.dtype),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def optimizer_dtensors(opt_state: Any, optimizer: Any) -> Any:
    """A loaded optimizer state with the state of FSDP2 (DTensor) parameters as DTensors:
    Megatron's checkpoint holds their local shards, torch's AdamW steps DTensors. A chained
    optimizer's state is one entry per optimizer (a single one: its own state)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        if len(chained) == 1:
            return optimizer_dtensors(opt_state, chained[0])
        entries = opt_state.items() if isinstance(opt_state, dict) else enumerate(opt_state)
        for (_, state), inner in zip(sorted(entries), chained, strict=False):
            optimizer_dtensors(state, inner)
        return opt_state
    inner = getattr(optimizer, "optimizer", None)
    if inner is None or not isinstance(opt_state, dict) or "state" not in opt_state:
        return opt_state
    params = [p for group in inner.param_groups for p in group["params"]]
    if not any(hasattr(p, "device_mesh") for p in params):
        return opt_state
    for index, values in opt_state["state"].items():
        if isinstance(index, int) and index < len(params) and isinstance(values, dict):
            for key, v in values.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    values[key] = as_dtensor(v, params[index])
    return opt_state


def zeros_like_local(like: Any) -> Any:
    """Zeros with DTensor ``like``'s local shape and layout (unevenly sharded ones included,
    where ``torch.zeros_like`` would assume even chunks): state for rows a rank does not hold."""
    return as_dtensor(torch.zeros_like(like.to_local()), like)


def bare(name: str) -> str:
    """A wrapped model's parameter name without the wrappers' ``module.`` prefixes."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name
