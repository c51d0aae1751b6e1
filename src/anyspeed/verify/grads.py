"""Gradients of one optimizer step, layout-independent: gathered over the distributed
optimizer's shards, written as a Megatron dist_checkpointing checkpoint (the parameters'
sharded keys, so any layout reads them back resharded), and compared tensor by tensor."""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

LAYER = re.compile(r"^(.*?layers\.)(\d+)(\..*)$")
EXPERT = re.compile(r"^(.*?local_experts\.)(\d+)(\..*)$")


def _bare(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def gather_sharded_grads(chunks: list[torch.nn.Module]) -> None:
    """Under the distributed optimizer each rank's gradient buffer holds only its reduced
    shard: all-gather the shards so that every ``main_grad`` is whole (the optimizer reads
    its own shard only, which is unchanged)."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in chunks:
        if not getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False):
            continue
        groups = [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]
        for group in groups:
            size = group.intra_distributed_optimizer_instance_size
            rank = group.intra_distributed_optimizer_instance_rank
            if size == 1:
                continue
            for bucket in group.buckets:
                shards = list(shard_buffer(bucket.grad_data, size))
                mine = shards[rank].clone()
                dist.all_gather(
                    shards, mine, group=group.intra_distributed_optimizer_instance_group
                )


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor:
    g = getattr(p, "main_grad", None)
    if g is None:
        g = p.grad
    if g is None:  # frozen (LoRA's base, a frozen tower): no gradient is a zero gradient
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return g.detach().float().view(p.shape)


@contextlib.contextmanager
def params_holding(
    chunks: list[torch.nn.Module], values: dict[int, torch.Tensor]
) -> Iterator[None]:
    """Every parameter's ``data`` replaced by ``values[id(param)]`` (and back): the model's
    sharded state dict then names those tensors under the parameters' keys."""
    saved = []
    for chunk in chunks:
        for p in _bare(chunk).parameters():
            saved.append((p, p.data))
            p.data = values[id(p)]
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def grads(chunks: list[torch.nn.Module]) -> dict[int, torch.Tensor]:
    """Each parameter's gradient (fp32, zeros for a frozen one), keyed by ``id(param)``."""
    return {id(p): _grad_of(p) for c in chunks for p in _bare(c).parameters()}


def save_grads(directory: str, chunks: list[torch.nn.Module]) -> None:
    """Write this step's gradients (after the data-parallel reduction) under ``directory``."""
    from megatron.core import dist_checkpointing

    from anyspeed.checkpoint.state import model_state

    bare = [_bare(c) for c in chunks]
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    with params_holding(chunks, grads(chunks)):
        dist_checkpointing.save(model_state(bare), directory)


def _global_name(chunk: torch.nn.Module, name: str) -> str:
    """``name`` with the chunk's local layer and expert numbers made global (the numbers the
    single-process model uses), so that every layout reports the same name."""
    from megatron.core import parallel_state as ps

    local, bare = name, _bare(chunk)
    e = EXPERT.match(local)
    if e:  # experts first: the module path below uses the local layer number
        per_rank = len(bare.get_submodule(e.group(1).rstrip(".")))
        rank = ps.get_expert_model_parallel_rank()
        name = f"{e.group(1)}{rank * per_rank + int(e.group(2))}{e.group(3)}"
    m = LAYER.match(local)
    if m:
        number = getattr(bare.get_submodule(m.group(1) + m.group(2)), "layer_number", None)
        if number is not None:
            name = LAYER.sub(lambda x: f"{x.group(1)}{number - 1}{x.group(3)}", name, count=1)
    return name


def compare_grads(reference: str, chunks: list[torch.nn.Module]) -> dict[str, list[float]]:
    """This rank's gradients against the reference's, read resharded into this layout:
    ``{global name: [sum of squared differences, sum of squared reference values]}`` over
    this rank's shard (replicated shards count each element equally often: the ratio holds)."""
    from megatron.core import dist_checkpointing

    from anyspeed.checkpoint.state import model_state

    bare = [_bare(c) for c in chunks]
    mine = grads(chunks)
    blank = {k: torch.zeros_like(v) for k, v in mine.items()}
    with params_holding(chunks, blank):
        loaded = dist_checkpointing.load(model_state(bare), reference)
    keys = ["model"] if len(bare) == 1 else [f"model{i}" for i in range(len(bare))]
    out: dict[str, list[float]] = {}
    for key, chunk in zip(keys, bare, strict=True):
        for name, p in chunk.named_parameters():
            if name not in loaded.get(key, {}):  # a tied copy (or a chunk of noop slots)
                continue
            ref, got = loaded[key][name].double(), mine[id(p)].double()
            diff = float(((got - ref) ** 2).sum())
            out[_global_name(chunk, name)] = [
                diff if math.isfinite(diff) else math.inf,
                float((ref**2).sum()),
            ]
    return out


def merge(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Every rank's shard sums as one ``[|difference|, |reference|]`` (L2 norms) per tensor."""
    sums: dict[str, list[float]] = {}
    for part in per_rank:
        for name, (d, r) in part.items():
            a, b = sums.get(name, [0.0, 0.0])
            sums[name] = [a + d, b + r]
    return {n: [math.sqrt(d), math.sqrt(r)] for n, (d, r) in sums.items()}


def model_order(name: str) -> tuple[int, int, str]:
    """Where a tensor sits from input to output: embeddings, layers in order, the rest."""
    m = LAYER.match(name)
    if m:
        return (1 if "mtp" not in m.group(1) else 2, int(m.group(2)), name)
    return (0 if name.startswith("embedding.") else 3, 0, name)


def differs(diff: float, norm: float, rtol: float, atol: float) -> bool:
    """A gradient differs when ``|g - ref| > atol + rtol * |ref|`` (L2 norms; NaN differs)."""
    return not diff <= atol + rtol * norm


def first_difference(
    diffs: dict[str, list[float]], rtol: float, atol: float
) -> tuple[str, float, float] | None:
    """The first tensor in model order whose gradient differs: (name, |difference|,
    |reference|)."""
    for name in sorted(diffs, key=model_order):
        diff, norm = diffs[name]
        if differs(diff, norm, rtol, atol):
            return name, *diffs[name]
    return None


def worst(diffs: dict[str, list[float]]) -> tuple[str, float] | None:
    """The tensor with the largest difference relative to its reference's norm."""
    if not diffs:
        return None
    rel = {n: d / s if s > 0 else (0.0 if d == 0 else math.inf) for n, (d, s) in diffs.items()}
    name = max(rel, key=lambda n: rel[n])
    return name, rel[name]


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` from every rank (a list on every rank)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
