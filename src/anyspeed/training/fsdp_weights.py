"""Weights of a torch_dist checkpoint (a converted Hugging Face model, a DDP run's) into a
``--use-megatron-fsdp`` run: each rank reads the whole tensors and keeps the rows of Megatron-FSDP's
sharded weights it holds. Megatron-FSDP's own checkpoints resume through
:mod:`anyspeed.checkpoint.fsdp_dtensor`; this is the weights-only start (``--finetune``, an HF
``--load``) from any other."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def fsdp_view(name: str, whole: torch.Tensor, tp: int) -> torch.Tensor:
    """Megatron tensor ``name`` as Megatron-FSDP's global DTensor holds it at TP size ``tp``:
    the TP ranks' shards one after another along the split dim (only a SwiGLU ``linear_fc1``
    differs from the whole tensor: each rank's gate rows, then its up rows)."""
    from anyspeed.distributed.resharding import materialize, shard_tp, tp_rule

    if tp == 1 or tp_rule(name) != "swiglu":
        return materialize(whole)
    return torch.cat([materialize(shard_tp(name, whole, tp, r)) for r in range(tp)], dim=0)


def _checkpoint_key(model: torch.nn.Module) -> Callable[[str], tuple[str, tuple[int, ...]]]:
    """Tensor name -> (its key in a dense model's torch_dist checkpoint, its layer on the
    key's stacked axis), with the renames the live model's layer spec saves under
    (``input_layernorm.`` as ``self_attention.linear_qkv.layer_norm_`` in the local spec)."""
    from anyspeed.distributed.resharding import LAYER

    maps = [
        dict(getattr(layer.submodules_config, "sharded_state_dict_keys_map", None) or {})
        for layer in model.decoder.layers
    ]

    def key(name: str) -> tuple[str, tuple[int, ...]]:
        m = LAYER.match(name)
        if m is None:
            return name, ()
        layer, rest = int(m.group(1)), name[m.end() :]
        for old, new in maps[layer].items():
            if rest.startswith(old):
                rest = new + rest[len(old) :]
                break
        return "decoder.layers." + rest, (layer,)

    return key


def load_weights(it_dir: str, chunks: list[torch.nn.Module], preset: Any) -> None:
    """The weights of the torch_dist checkpoint ``it_dir`` (of the model ``preset`` describes)
    into the Megatron-FSDP ``chunks``; every rank calls it."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        gather_and_compute_chunk_metadata,
    )

    from anyspeed.checkpoint.errors import CheckpointMismatch
    from anyspeed.convert.torch_dist import read_torch_dist
    from anyspeed.distributed.dtensors import bare

    tp = ps.get_tensor_model_parallel_world_size()
    targets = {
        bare(k): v
        for k, v in chunks[0].state_dict().items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }
    names = sorted(targets)
    if preset.is_moe:
        raise CheckpointMismatch(
            f"{it_dir}: starting a --use-megatron-fsdp MoE model from a torch_dist checkpoint "
            "is not supported yet; start it from scratch, or train it without Megatron-FSDP"
        )
    keys = _checkpoint_key(chunks[0].module)
    (_, whole), *_ = read_torch_dist(Path(it_dir), preset, lambda _: names, ["all"], keys)
    with torch.no_grad():
        for name in names:  # one order on every rank: the offsets are agreed collectively
            target = targets[name]
            meta = gather_and_compute_chunk_metadata(target)
            view = fsdp_view(name, whole[name], tp)
            rows = tuple(slice(o, o + s) for o, s in zip(meta.offsets, meta.sizes, strict=True))
            local = target.to_local()
            if local.numel():
                local.copy_(view[rows].to(local.dtype))
    chunks[0].install_optimized_model_weights()
