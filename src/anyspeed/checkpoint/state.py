"""What saves and loads share: the checkpoint version, the model state of unwrapped chunks,
Megatron's sharding metadata, the layout signature and the failures every rank agrees on."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from anyspeed.distributed.dtensors import as_dtensor

CHECKPOINT_VERSION = 3.0


def optimizer_sharding(optimizer: Any) -> str:
    """How the distributed optimizer's state is laid out in the checkpoint.

    ``fully_reshardable`` (model space: loads under any TP/PP/DP) needs one gradient bucket per
    buffer: megatron-core 0.16.1 misplaces state across the padding between several buckets.
    With several buckets, ``dp_reshardable`` (Megatron-LM's default; reshards over DP only).
    """
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for buffer in getattr(o, "buffers", []):
            if len(buffer.buckets) > 1:
                return "dp_reshardable"
    return "fully_reshardable"


def sharding_metadata(sharding: str = "fully_reshardable") -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "distrib_optim_sharding_type": sharding,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def unwrapped(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The chunks inside training's DDP wrappers (what holds the sharded state dict)."""
    return [m.module for m in model]


def model_state(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """Megatron-LM's model entries of bare chunks: ``model`` (``model0``, ``model1`` for
    virtual stages)."""
    meta = {"dp_cp_group": sharding_metadata()["dp_cp_group"]}
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=meta)}
    return {f"model{i}": c.sharded_state_dict(metadata=meta) for i, c in enumerate(chunks)}


def load_model_entries(chunks: list[torch.nn.Module], state: dict[str, Any]) -> None:
    """Load each chunk's entry; FSDP2 chunks (DTensor parameters) take their loaded local
    shards as DTensors."""
    for i, chunk in enumerate(chunks):
        # (a chunk of noop slots only holds nothing, and dist_checkpointing returns no entry)
        entry = state["model"] if len(chunks) == 1 else state.get(f"model{i}", {})
        current = chunk.state_dict()
        if any(hasattr(v, "device_mesh") for v in current.values()):
            entry = {k: as_dtensor(v, current.get(k)) for k, v in entry.items()}
        chunk.load_state_dict(entry)


def set_aside(state: dict[str, Any], keep: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Take the model entries whose key starts with a prefix in ``keep`` out of ``state``;
    their current values by entry, to load back unchanged."""
    kept: dict[str, dict[str, Any]] = {}
    if not keep:
        return kept
    for entry, sd in state.items():
        for key in [k for k in sd if k.startswith(keep)]:
            kept.setdefault(entry, {})[key] = sd.pop(key).data.detach().clone()
    return kept


def layout_signature() -> dict[str, int]:
    """The parallel sizes of this run (RNG state is per rank, so it only loads under these)."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


# What a failed save or load raises: torch.distributed.checkpoint gathers its ranks' errors into
# a CheckpointException, which derives from BaseException.
FAILURES = (Exception, CheckpointException)


def is_distributed(optimizer: Any) -> bool:
    """Whether ``optimizer`` is Megatron's distributed (ZeRO-1) optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in parts)
