"""How tensor- and expert-parallel shards of Megatron tensors join and split: one definition for
the checkpoint converter (files at any layout) and for rollouts (a live model gathered whole).

Megatron splits a column-parallel tensor by rows, a row-parallel one by columns, SwiGLU's
``[gate; up]`` part by part, a gated DeltaNet's input projection and convolution part by part,
and keeps the rest whole on every rank. Dim-0 joins and splits stay row views
(:class:`Stacked`) until a writer needs bytes.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import torch

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")  # Megatron's SequentialMLP
ADAPTER = re.compile(r"\.lora_[AB]$")  # a LoRA adapter is split as the layer it adapts

COLUMN = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "core_attention.softmax_offset",  # one sink per head: split with the heads
    "word_embeddings.weight",
    "output_layer.weight",
    "linear_q_proj.weight",
    "linear_q_down_proj.weight",
    "linear_q_up_proj.weight",
    "eh_proj.weight",  # MTP: [embedding; hidden] -> hidden, gathered after
    "linear_kv_up_proj.weight",
    "A_log",  # a gated DeltaNet's per-value-head decay
    "dt_bias",
)
# MLA's KV down-projection is whole on every TP rank (see models.mla.DuplicatedLinear).
ROW = ("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")
SWIGLU = ("linear_fc1.weight", "linear_fc1.bias")
# Tensors Megatron splits over TP part by part (a gated DeltaNet's input projection and
# convolution): each rank holds its rows of every part.
TP_PARTS = ("self_attention.in_proj.weight", "self_attention.conv1d.weight")


class DeltaNetShape(Protocol):
    """What :func:`tp_parts` reads of a model config (anyspeed.models.config.ModelConfig)."""

    linear_num_key_heads: Any
    linear_key_head_dim: Any
    linear_num_value_heads: Any
    linear_value_head_dim: Any

    def linear_attention_layers(self) -> list[bool]: ...


# -------------------------------------------------------------------------------- row views
class Stacked:
    """``torch.cat(parts)`` along dim 0, not yet materialised: a writer that stores the parts
    as separate chunks (torch_dist keeps SwiGLU's gate and up apart) takes them as they are,
    and the safetensors writer writes them one after another (mapped ones file to file)."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts
        self.shape = torch.Size((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
        self.dtype = parts[0].dtype

    def materialize(self) -> torch.Tensor:
        return torch.cat(self.parts, dim=0)


def materialize(t: torch.Tensor | Stacked) -> torch.Tensor:
    """A real tensor for ``t`` (a copy only when it is a :class:`Stacked`)."""
    return t.materialize() if isinstance(t, Stacked) else t


def take_rows(t: torch.Tensor | Stacked, ranges: list[tuple[int, int]]) -> torch.Tensor | Stacked:
    """Rows ``ranges`` of ``t`` one after another, as views: one tensor, or a :class:`Stacked`."""
    parts: list[torch.Tensor] = []
    for lo, hi in ranges:
        if not isinstance(t, Stacked):
            parts.append(t[lo:hi])
            continue
        at = 0
        for p in t.parts:
            a, b = max(lo, at), min(hi, at + p.shape[0])
            if a < b:
                parts.append(p[a - at : b - at])
            at += p.shape[0]
    return parts[0] if len(parts) == 1 else Stacked(parts)


def tp_parts(name: str, preset: DeltaNetShape | None) -> tuple[int, ...] | None:
    """The parts (full rows) that TP splits Megatron tensor ``name`` in one by one, or None."""
    if preset is None or not name.endswith(TP_PARTS) or not any(preset.linear_attention_layers()):
        return None
    hv = preset.linear_num_value_heads
    qk = preset.linear_num_key_heads * preset.linear_key_head_dim
    v = hv * preset.linear_value_head_dim
    return (qk, qk, v, v, hv, hv) if name.endswith(TP_PARTS[0]) else (qk, qk, v)


# ------------------------------------------------------------------------ tensor parallelism
def tp_rule(name: str) -> str:
    """column, row, swiglu or replicated: how TP splits Megatron tensor ``name``."""
    for kind, suffixes in (("column", COLUMN), ("row", ROW), ("swiglu", SWIGLU)):
        if name.endswith(suffixes):
            return kind
    return "replicated"


def shard_tp(
    name: str, t: torch.Tensor | Stacked, tp: int, rank: int, sizes: tuple[int, ...] | None = None
) -> torch.Tensor | Stacked:
    """Rank ``rank``'s shard (of ``tp``) of Megatron tensor ``name``, as Megatron-LM shards it.
    Dim-0 shards are row views; only a row-parallel (dim-1) shard is a copy. ``sizes``: the
    parts a tensor is split in part by part (:func:`tp_parts`)."""
    rule = tp_rule(name)
    if tp == 1 or (rule == "replicated" and not sizes):
        return t
    n = t.shape[0]
    if rule == "swiglu":  # this rank's gate rows, then its up rows
        sizes = (n // 2, n // 2)
    if sizes:  # this rank's rows of each part, part after part
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return take_rows(
            t,
            [
                (a + rank * (p // tp), a + (rank + 1) * (p // tp))
                for a, p in zip(starts, sizes, strict=True)
            ],
        )
    if rule == "column":
        return take_rows(t, [(rank * n // tp, (rank + 1) * n // tp)])
    return materialize(t).chunk(tp, dim=1)[rank].contiguous()


def shard_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape of every rank's :func:`shard_tp` of a tensor of ``shape`` (nothing copied)."""
    rule = tp_rule(name)
    if tp == 1 or (rule == "replicated" and not name.endswith(TP_PARTS)):
        return tuple(shape)
    if rule == "row":
        return (shape[0], shape[1] // tp, *shape[2:])
    return (shape[0] // tp, *shape[1:])


def merge_tp(
    name: str, parts: list[torch.Tensor], sizes: tuple[int, ...] | None = None
) -> torch.Tensor | Stacked:
    """Inverse of :func:`shard_tp` over all ranks; dim-0 merges stay a :class:`Stacked`."""
    rule = tp_rule(name)
    if len(parts) == 1 or (rule == "replicated" and not sizes):
        return parts[0]
    if rule == "swiglu":
        sizes = (parts[0].shape[0] * len(parts) // 2,) * 2
    if sizes:  # every rank's rows of part 0, then of part 1, ...
        local = [p // len(parts) for p in sizes]
        split = [torch.split(p, local, dim=0) for p in parts]
        return Stacked([s[i] for i in range(len(sizes)) for s in split])
    if rule == "column":
        return Stacked(list(parts))
    return torch.cat(parts, dim=1)


# ------------------------------------------------------------- a live model, gathered whole
def state_tensors(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of (unwrapped) model chunk ``chunk`` by local name, detached."""
    return {
        n: t.detach()
        for n, t in chunk.state_dict(keep_vars=True).items()
        if isinstance(t, torch.Tensor) and not n.endswith("_extra_state")
    }


def global_layer_numbers(chunk: torch.nn.Module) -> dict[int, int]:
    """(Unwrapped) chunk ``chunk``'s local decoder layer index -> global index."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", [])
    return {i: layer.layer_number - 1 for i, layer in enumerate(layers)}


def global_name(name: str, numbers: dict[int, int]) -> str:
    """Local tensor name ``name`` of a pipeline chunk with its decoder layer numbered globally."""
    if m := LAYER.match(name):
        return f"decoder.layers.{numbers[int(m.group(1))]}." + name[m.end() :]
    return name


def gather_whole(
    chunks: list[torch.nn.Module], shapes: dict[str, torch.Size], preset: Any
) -> dict[str, torch.Tensor]:
    """This pipeline stage's tensors whole, by global name, for the names in ``shapes`` (their
    whole shapes): tensor-parallel shards all-gathered and joined by :func:`merge_tp`, experts
    all-gathered over expert parallelism and numbered globally. Every rank of the stage calls
    it; ``chunks`` are unwrapped."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ep, ep_group = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_group()
    groups = {
        False: ps.get_tensor_model_parallel_group(),
        True: ps.get_expert_tensor_parallel_group(),
    }
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        numbers = global_layer_numbers(chunk)
        for name, t in state_tensors(chunk).items():
            name = global_name(name, numbers)
            want = shapes.get(name)
            if want is None:  # e.g. the tied output weight's copy on the last stage
                continue
            expert = LOCAL_EXPERT.search(name)
            t = _joined(name, t, want, groups[expert is not None], preset)
            if expert is None or ep == 1:
                out[name] = t
                continue
            # experts: this rank's are local_experts.0..n-1; EP rank x holds x*n .. x*n+n-1
            parts = [torch.empty_like(t) for _ in range(ep)]
            dist.all_gather(parts, t.contiguous(), group=ep_group)
            n, i = (preset.num_experts or 0) // ep, int(expert.group(2))
            head, tail = name[: expert.start()], name[expert.end() :]
            for x, part in enumerate(parts):
                out[f"{head}{expert.group(1)}{x * n + i}.{tail}"] = part
    return out


def _joined(name: str, t: torch.Tensor, shape: torch.Size, group: Any, preset: Any) -> torch.Tensor:
    """``t`` whole: its shards over ``group`` all-gathered and joined; ``t`` where not split."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1 or shape == t.shape:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    how = ADAPTER.sub(".weight", name)  # an adapter is split as its layer
    return materialize(merge_tp(how, parts, tp_parts(how, preset)))


def broadcast_stages(mine: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> set[str]:
    """Every pipeline stage's whole tensors (``mine`` on this rank) copied into ``targets`` on
    every rank of the pipeline; the names filled."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for name, t in mine.items():
        targets[name].copy_(t)
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return set(mine)
    group, me = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    names: list[Any] = [None] * pp
    dist.all_gather_object(names, sorted(mine), group=group)
    ranks = dist.get_process_group_ranks(group)
    for stage, stage_names in enumerate(names):
        for name in stage_names:
            buf = targets[name]
            # broadcast works on a contiguous tensor: the target itself, or a copy of it
            flat = buf if buf.is_contiguous() else buf.contiguous()
            dist.broadcast(flat, src=ranks[stage], group=group)
            if stage != me and flat is not buf:
                buf.copy_(flat)
    return {n for stage_names in names for n in stage_names}
