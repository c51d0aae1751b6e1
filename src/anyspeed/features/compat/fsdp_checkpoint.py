"""Megatron-LM's ``--ckpt-format fsdp_dtensor`` (Megatron-FSDP's checkpoints in
``pretrain_gpt.py``) for fp32 SwiGLU models, where Megatron-LM 0.16.1's own preprocessing fails:

- its SwiGLU split looks the optimizer's parameters up under one ``module.`` too few (only a
  ``Float16Module`` wrapper supplies it), an AttributeError;
- past that, splitting Adam's moments fails its own chunk check;
- without the split, the per-tensor offset exchange deadlocks: a rank that holds no rows of a
  parameter has no Adam state for it, so the ranks visit different tensors.

Here ``linear_fc1`` is saved whole (a resume keeps the TP size), and every parameter the optimizer
knows gets its moments on every rank (zeros with no rows where the rank holds none), visited in
one sorted order, so the offset exchange pairs up. Saved and loaded alike, as Megatron-LM calls
the same preprocessing on both sides.
"""

from __future__ import annotations

import functools
from typing import Any


def every_parameter_state(optimizer: dict, model: dict) -> dict:
    """The fsdp_dtensor optimizer entry with the Adam moments of every parameter in its groups,
    in sorted order: a rank holding no rows of a parameter gets empty moments laid out as it."""
    from anyspeed.distributed.dtensors import bare, zeros_like_local

    params = {bare(k): v for k, v in model.items() if hasattr(v, "device_mesh")}
    state = dict(optimizer.get("state", {}))
    for name in optimizer.get("param_to_group_meta", {}):
        like = params.get(bare(name))
        if name in state or like is None:
            continue
        state[name] = {"exp_avg": zeros_like_local(like), "exp_avg_sq": zeros_like_local(like)}
    return {**optimizer, "state": dict(sorted(state.items()))}


def fp32_fsdp_dtensor_state(previous: Any) -> Any:
    """Megatron-LM's ``preprocess_fsdp_dtensor_state_dict``, done as described above for fp32
    runs (no ``Float16Module``); bf16/fp16 runs keep Megatron-LM's own."""

    @functools.wraps(previous)
    def preprocess_fsdp_dtensor_state_dict(args: Any, raw_state_dict: dict, model: Any) -> dict:
        if getattr(args, "bf16", False) or getattr(args, "fp16", False):
            return previous(args, raw_state_dict, model)
        from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
            preprocess_state_dict_for_uneven_dtensor,
        )

        state = raw_state_dict.copy()
        if "optimizer" in state:
            state["optimizer"] = every_parameter_state(state["optimizer"], state.get("model", {}))
        preprocess_state_dict_for_uneven_dtensor(state)
        return state

    return preprocess_fsdp_dtensor_state_dict
