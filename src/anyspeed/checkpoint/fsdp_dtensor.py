"""Checkpoints of ``--use-megatron-fsdp`` runs: PyTorch Distributed Checkpoint files of the
sharded (DTensor) weights and Adam moments, beside the same ``common.pt`` and tracker as every
anyspeed checkpoint.

Megatron-FSDP shards each parameter by whole rows, unevenly (a rank may hold none of a tensor),
and its distributed optimizer writes only its ``fsdp_dtensor`` state, which Megatron's torch_dist
format does not take. Here every tensor is keyed by its model name (``model.<name>``,
``optimizer.<name>.exp_avg``, ...), each rank writes the rows it holds with their global offsets,
and a load reads whichever rows the loading rank holds: a run resumes at another number of
data-parallel ranks. The tensor-parallel size stays as saved (Megatron-FSDP's global view of a
SwiGLU ``linear_fc1`` interleaves the TP ranks' halves); ``anyspeed convert`` turns the
checkpoint into a Hugging Face directory at any size
(:func:`anyspeed.convert.megatron_io.read_fsdp_dtensor`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from anyspeed.distributed.dtensors import bare, zeros_like_local

BACKEND = "fsdp_dtensor"
MOMENTS = ("exp_avg", "exp_avg_sq")


def is_megatron_fsdp(chunks: list[torch.nn.Module]) -> bool:
    """Whether the model chunks inside training's wrappers are Megatron-FSDP modules."""
    return bool(chunks) and hasattr(chunks[0], "param_and_grad_buffer")


def _optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _moments(optimizer: Any, params: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """Each parameter's Adam moments by bare name (zeros where this rank holds no rows) and the
    optimizer's step count."""
    state: dict[str, Any] = {}
    for opt in _optimizers(optimizer):
        packed = opt.sharded_param_state_fsdp_dtensor()["state"]
        state.update({bare(k): v for k, v in packed.items()})
    out, step = {}, None
    for name, p in params.items():
        values = state.get(name, {})
        if "step" in values:
            step = float(values["step"])
        for m in MOMENTS:
            out[f"optimizer.{name}.{m}"] = values[m] if m in values else zeros_like_local(p)
    return out, step


def _state(chunks: list[torch.nn.Module], optimizer: Any | None) -> tuple[dict, float | None]:
    """The flat DCP state dict (sorted, so every rank visits the tensors in one order)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        update_uneven_dtensor_chunk_metadata,
    )

    params = {bare(k): v for k, v in chunks[0].state_dict().items() if isinstance(v, torch.Tensor)}
    flat = {f"model.{k}": v for k, v in params.items()}
    step = None
    if optimizer is not None:
        moments, step = _moments(optimizer, params)
        flat.update(moments)
    flat = dict(sorted(flat.items()))
    for value in flat.values():  # rows held here and their global offsets, agreed by the ranks
        update_uneven_dtensor_chunk_metadata(value)
    return flat, step


def save(
    directory: str, chunks: list[torch.nn.Module], optimizer: Any | None, common: dict
) -> None:
    """Write ``directory`` (already made): the DCP files of every rank, then rank 0's
    ``common.pt`` (with the optimizer's step count) and ``metadata.json``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    flat, step = _state(chunks, optimizer)
    dcp.save(flat, checkpoint_id=directory)
    if dist.get_rank() == 0:
        common = dict(common, optimizer_step=step, checkpoint_format=BACKEND)
        torch.save(common, os.path.join(directory, "common.pt"))
        with open(os.path.join(directory, "metadata.json"), "w") as fh:
            json.dump({"sharded_backend": BACKEND}, fh)


def load(
    directory: str, chunks: list[torch.nn.Module], optimizer: Any | None, common: dict
) -> None:
    """Read the weights (and, with ``optimizer``, the moments and step) of the rows this rank
    holds, in place; Megatron-FSDP then refreshes its compute copy of the weights."""
    import torch.distributed.checkpoint as dcp

    if optimizer is not None:  # Adam's state must exist before it is overwritten in place
        for opt in _optimizers(optimizer):
            if not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()
    flat, _ = _state(chunks, optimizer)
    dcp.load(flat, checkpoint_id=directory)
    if optimizer is not None and common.get("optimizer_step") is not None:
        for opt in _optimizers(optimizer):
            for values in opt.optimizer.state.values():
                if "step" in values:
                    values["step"] = torch.full_like(
                        torch.as_tensor(values["step"]), common["optimizer_step"]
                    )
    chunks[0].install_optimized_model_weights()
