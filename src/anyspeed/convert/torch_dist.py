"""Megatron-Core's torch_dist checkpoints: written from full tensors one layer group at a time,
and read back region by region, with the sharded keys Megatron's own GPTModel gives."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.checkpoint.files import RELEASE, iteration_dir, write_tracker
from anyspeed.convert.engine import Group, Stacked
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.megatron_io import LAYER, MTP_LAYER, empty_model, megatron_session
from anyspeed.models.config import ModelConfig
from anyspeed.models.reward_head import HEAD_KEY

if TYPE_CHECKING:
    from anyspeed.convert.dcp_io import DcpReader


def _group_index(preset: ModelConfig) -> Callable[[str], int]:
    """Megatron tensor name -> its position in :func:`engine.groups` order."""

    mtp = preset.mtp_num_layers or 0

    def index(name: str) -> int:
        if mt := LAYER.match(name):
            return 1 + int(mt.group(1))
        if mt := MTP_LAYER.match(name):
            return 1 + preset.num_layers + int(mt.group(1))
        return 0 if name.startswith("embedding.") else preset.num_layers + mtp + 1

    return index


def save_torch_dist(
    out_dir: Path,
    preset: ModelConfig,
    dtype: torch.dtype,
    tensor_groups: Iterator[dict[str, torch.Tensor]],
    common: dict,
    reward: bool = False,
) -> None:
    """Write ``out_dir/release`` + tracker from the full Megatron tensors of every group, in
    ``engine.groups`` order. Each group is converted when the writer reaches it and dropped
    when written (see :mod:`.dcp_io`), so one group is in memory, not the model. ``reward``:
    the model has a reward head in place of its output layer (``--stage orm``'s)."""
    from megatron.core import dist_checkpointing

    from anyspeed.convert.dcp_io import streaming_save_strategy
    from anyspeed.convert.pipeline import prefetch

    with megatron_session():
        model = empty_model(preset, dtype)  # uninitialised: placeholders, never touched
        if reward:
            from anyspeed.models.reward_head import reward_head

            model = reward_head(model, None)
        placeholders = dict(model.state_dict(keep_vars=True))
        strategy = streaming_save_strategy(
            {k: v for k, v in placeholders.items() if isinstance(v, torch.Tensor)},
            _group_index(preset),
            prefetch(tensor_groups),
        )
        release = Path(iteration_dir(out_dir, RELEASE))
        release.mkdir()
        dist_checkpointing.save(
            {"model": model.sharded_state_dict(), **common}, str(release), strategy
        )
    write_tracker(out_dir, RELEASE)


def _few_experts(preset: ModelConfig) -> ModelConfig:
    """``preset`` with the fewest experts its router accepts: a layer's experts share one
    checkpoint key whatever their number, and building 128 of them took 0.3 s."""
    if not preset.is_moe:
        return preset
    groups = preset.moe_router_num_groups or 1
    per_group = -(-preset.moe_router_topk // (preset.moe_router_group_topk or groups))
    return dataclasses.replace(preset, num_experts=min(preset.num_experts, groups * per_group))


def _layer_kinds(preset: ModelConfig) -> list[tuple[bool, bool]]:
    """Each layer's kind: (MoE, gated DeltaNet)."""
    return list(zip(preset.moe_layers(), preset.linear_attention_layers(), strict=True))


def _probe(preset: ModelConfig) -> tuple[ModelConfig, dict[Any, int]]:
    """A model with one layer of each kind ``preset`` has (dense and/or MoE; attention and/or
    gated DeltaNet), and which of its layers is of each kind: every layer of a kind has the same
    tensors."""
    if any(preset.linear_attention_layers()):
        kinds = list(dict.fromkeys(_layer_kinds(preset)))
        bits = lambda i: "[" + ",".join(str(int(k[i])) for k in kinds) + "]"  # noqa: E731
        probe = dataclasses.replace(
            _few_experts(preset),
            num_layers=len(kinds),
            moe_layer_freq=bits(0),
            linear_attention_freq=bits(1),
        )
        return probe, {k: j for j, k in enumerate(kinds)}
    kinds = preset.moe_layers()
    preset = _few_experts(preset)
    if not any(kinds):
        return dataclasses.replace(preset, num_layers=1), {False: 0}
    if all(kinds):
        return dataclasses.replace(preset, num_layers=1, moe_layer_freq="1"), {True: 0}
    return dataclasses.replace(preset, num_layers=2, moe_layer_freq="[0]*1+[1]*1"), {
        False: 0,
        True: 1,
    }


# The parts Megatron's GatedDeltaNet saves its in_proj and conv1d in, in order.
SPLIT_PARTS = ("query", "key", "value", "z", "beta", "alpha")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.")


def checkpoint_keys(preset: ModelConfig) -> Callable[[str], tuple[str, tuple[int, ...]]]:
    """Megatron tensor name -> (its sharded key in a checkpoint, its index on the key's leading
    axes: the layer of a layer-stacked key, or the expert of an expert-stacked one).

    The keys come from Megatron's own GPTModel (its spec renames some, e.g. the local spec saves
    ``input_layernorm.weight`` as ``self_attention.linear_qkv.layer_norm_weight``), asked of a
    model with one layer of each kind. A dense model stacks its layers on one key; a MoE model
    keys each layer apart and stacks a layer's experts on one key.
    """
    probe, layer_of_kind = _probe(preset)
    with megatron_session():
        sd = empty_model(probe, torch.float32)
        keys = {n: e.key for n, e in sd.sharded_state_dict().items() if hasattr(e, "key")}
    hybrid = any(preset.linear_attention_layers())
    kinds: list[Any] = _layer_kinds(preset) if hybrid else preset.moe_layers()
    keyed = preset.is_moe or hybrid  # Megatron keys each layer apart (not layer-stacked)

    def key(name: str) -> tuple[str, tuple[int, ...]]:
        mt = LAYER.match(name)
        if mtp := MTP_LAYER.match(name):  # the probe has every MTP layer: keyed per layer
            rest = name[mtp.end() :]
            expert = _EXPERT.match(rest)
            if expert:
                rest = f"mlp.experts.local_experts.0.{rest[expert.end() :]}"
            probe_name = name[: mtp.end()] + rest
            index = (int(expert.group(1)),) if expert else ()
        elif not mt:
            probe_name, index = name, ()
        else:
            layer, rest = int(mt.group(1)), name[mt.end() :]
            j = layer_of_kind[kinds[layer]]
            expert = _EXPERT.match(rest)
            if expert:
                rest = f"mlp.experts.local_experts.0.{rest[expert.end() :]}"
            probe_name = f"decoder.layers.{j}.{rest}"
            index = (int(expert.group(1)),) if expert else () if keyed else (layer,)
        if probe_name == HEAD_KEY:  # a reward model's head: its own, unstacked key
            return HEAD_KEY, ()
        if probe_name not in keys:
            raise ConvertError(f"internal: Megatron's GPTModel has no tensor {name}")
        found = keys[probe_name]
        if mt and keyed:  # per-layer keys: the probe's layer number -> this layer's
            found = found.replace(f"decoder.layers.{j}.", f"decoder.layers.{layer}.", 1)
        return found, index

    return key


def read_torch_dist(
    it_dir: Path,
    preset: ModelConfig,
    group_names: Callable[[Group], list[str]],
    groups: list[Group],
    checkpoint_key: Callable[[str], tuple[str, tuple[int, ...]]] | None = None,
) -> Iterator[tuple[Group, dict[str, torch.Tensor | Stacked]]]:
    """Full Megatron tensors, one group at a time, read straight from the checkpoint's files.

    Each tensor is one region of the checkpoint's global tensor (a layer's or an expert's slice
    of a stacked key), assembled from whatever chunks the saving layout wrote. ``checkpoint_key``
    (default: :func:`checkpoint_keys`, which builds a model in a process of its own) maps a
    tensor name to its key and index.
    """
    from anyspeed.convert.dcp_io import DcpReader

    reader = DcpReader(it_dir)
    checkpoint_key = checkpoint_key or checkpoint_keys(preset)
    for group in groups:
        out = {}
        for name in group_names(group):
            key, index = checkpoint_key(name)
            out[name] = read_entry(reader, key, index, it_dir)
        yield group, out


def read_entry(
    reader: DcpReader, key: str, index: tuple[int, ...], it_dir: Path
) -> torch.Tensor | Stacked:
    """The tensor at ``index`` on the leading axis of checkpoint key ``key`` (the whole
    key when ``index`` is empty), as :func:`checkpoint_keys` names it; lazy where it can be.
    A tensor Megatron saves in named parts (a gated DeltaNet's ``in_proj``: ``.query``,
    ``.key``, ...) is its parts one after another."""
    parts = [f"{key}.{p}" for p in SPLIT_PARTS if f"{key}.{p}" in reader.tensors]
    if key not in reader.tensors and parts:
        views = [read_entry(reader, p, index, it_dir) for p in parts]
        return Stacked([v for t in views for v in (t.parts if isinstance(t, Stacked) else [t])])
    shape = reader.shape(key)
    if not index:
        return reader.read(key, (0,) * len(shape), shape)
    if index[0] >= shape[0]:
        raise ConvertError(f"{it_dir}: {key} has {shape[0]} entries, not {index[0] + 1}")
    at = index + (0,) * (len(shape) - 1)
    return reader.read(key, at, (1, *shape[1:]), squeeze=1)
