"""LoRA on MoE experts: one adapter pair per expert, as MindSpeed-LLM's LoRA on MoE models has.

Each routed expert's ``linear_fc1`` / ``linear_fc2`` gets its own ``lora_A`` [r, in] and
``lora_B`` [out, r], numbered by the expert's *global* index, so every expert-parallel layout
starts from the same adapters and saves them under the keys the expert weights use
(``mlp.experts.experts.linear_fc1.lora_A``, stacked over the experts): a checkpoint moves
between EP sizes, between ``SequentialMLP`` and ``--moe-grouped-gemm``, and ``anyspeed convert
--lora-load`` merges it expert by expert.

Expert layers do no tensor-parallel communication of their own (the token dispatcher gathers
their tokens and reduces their outputs), so neither do their adapters. Under expert TP > 1 the
factor every expert-TP rank holds whole (a column layer's ``lora_A``, a row layer's ``lora_B``)
gets only this rank's share of its gradient; it is summed over the expert-TP group on its way
back, the rank-r all-reduce of an identity. With ``SequentialMLP`` the adapters sit on the
experts' own linear layers (``training/lora.py``); with ``GroupedMLP`` they sit in
:class:`GroupedAdapters`, which the grouped forward (``features/moe/grouped_gemm.py``) asks for
the adapters' terms.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from anyspeed.models.lora import A, B

FC1, FC2 = "linear_fc1", "linear_fc2"
_LOCAL = re.compile(r"^(?P<experts>.*)\.local_experts\.(?P<i>\d+)\.(?P<rest>.*)$")


def global_name(layer: torch.nn.Module, name: str) -> str:
    """A layer's module name with a sequential expert's local index made global
    (``mlp.experts.local_experts.1.linear_fc1`` -> ``mlp.experts.experts.5.linear_fc1`` on the
    second of two expert-parallel ranks of four local experts); other names unchanged."""
    mt = _LOCAL.match(name)
    if not mt:
        return name
    experts = layer.get_submodule(mt["experts"])
    first = experts.ep_group.rank() * experts.num_local_experts
    return f"{mt['experts']}.experts.{first + int(mt['i'])}.{mt['rest']}"


def summed_grad(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` itself, its gradient summed over ``group`` (the expert-TP group) when that has
    more than one rank: a factor each rank holds whole gets, on each rank, only the part of its
    gradient that flows through that rank's shard of the other factor."""
    if group is None or group.size() == 1:
        return t
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(t, group=group)


def mark(factor: torch.nn.Parameter, weight: torch.Tensor, sharded: bool, dim: int) -> None:
    """An expert adapter's attributes, as its weight's: reduced over the expert-data-parallel
    group when the weight is, and counted in the grad norm on every rank that holds it apart
    (a factor is a duplicate only across an expert-TP group of more than one rank)."""
    from megatron.core import tensor_parallel as tpl

    factor.allreduce = getattr(weight, "allreduce", True)
    if sharded:
        tpl.set_tensor_model_parallel_attributes(factor, True, dim, 1)


def adapter_shards(
    owner: torch.nn.Module,
    prefix: str,
    sharded_offsets: tuple,
    metadata: dict | None,
    column: bool,
    tp_group: Any,
    gated: bool,
    split: bool = True,
) -> dict:
    """``owner``'s ``lora_A`` / ``lora_B`` as sharded tensors, split as a column (``lora_B``
    by rows) or row (``lora_A`` by columns) layer's weight is over ``tp_group``; a gated fc1's
    ``lora_B`` as Megatron saves the weight (global [gate; up]). Every adapter's, the dense
    layers' (``training/lora.py``) and the grouped experts' alike."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    dp_cp = (metadata or {}).get("dp_cp_group")
    groups = {"tp_group": tp_group, "dp_cp_group": dp_cp} if dp_cp is not None else {}
    own = {A: getattr(owner, A), B: getattr(owner, B)}
    axes = ({B: 0} if column else {A: 1}) if split else {}  # not split: each rank's whole
    out = make_sharded_tensors_for_checkpoint(own, prefix, axes, sharded_offsets, **groups)
    if gated:
        single = (metadata or {}).get("singleton_local_shards", False)
        key = f"{prefix}{B}"
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, single)
    return out


class ExpertAdapter(torch.nn.Module):
    """The adapters of one expert's layer of a ``GroupedMLP``: ``lora_A`` [r, in] and
    ``lora_B`` [out, r] on this rank (the weight's shard of each)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        setattr(self, A, torch.nn.Parameter(a))
        setattr(self, B, torch.nn.Parameter(b))


class GroupedAdapters(torch.nn.Module):
    """The per-expert adapters of one ``GroupedMLP`` (a child of it, ``lora_adapters``)."""

    def __init__(self, mlp: torch.nn.Module, key: str, targets: list[str], lora: Any) -> None:
        """``key``: the MLP's global name (``3.mlp.experts``); ``lora``: r, scale, dropout and
        ``init_a(key, r, fan_in)``, the dense layers' own initialisation."""
        super().__init__()
        cfg = mlp.config
        n, tp, rank = mlp.num_local_experts, mlp.tp_group.size(), mlp.tp_group.rank()
        self.first = mlp.ep_group.rank() * n
        self.n_global = mlp.ep_group.size() * n
        self.mlp_groups = (mlp.tp_group, mlp.dp_group)
        self.scale, self.dropout, self.lora_key = lora.scale, lora.dropout, key
        self.gated = bool(cfg.gated_linear_unit)
        ffn, h = cfg.moe_ffn_hidden_size, cfg.hidden_size
        dtype, dev = mlp.weight1.dtype, mlp.weight1.device
        self.parts = torch.nn.ModuleDict()
        for target in (FC1, FC2):
            if target not in targets:
                continue
            column = target == FC1
            out_local = ffn * (2 if self.gated else 1) // tp if column else h
            weight = mlp.weight1 if column else mlp.weight2
            experts = torch.nn.ModuleList()
            fan_in = h if column else ffn
            for i in range(n):
                a = lora.init_a(f"{key}.experts.{self.first + i}.{target}", lora.r, fan_in)
                a = a if column else a.chunk(tp, dim=1)[rank]
                b = torch.zeros(out_local, lora.r, dtype=dtype, device=dev)
                adapter = ExpertAdapter(a.to(dtype).to(dev).contiguous(), b)
                mark(adapter.lora_B, weight, column or tp == 1, 0)
                mark(adapter.lora_A, weight, not column or tp == 1, 1)
                experts.append(adapter)
            self.parts[target] = experts
        self.lora_off = False

    def add(
        self,
        target: str,
        out: torch.Tensor,
        x: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        grouped_matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``out`` (the grouped product of ``x``) plus ``scale * B_e A_e x`` per expert's rows."""
        if self.lora_off or target not in self.parts:
            return out
        experts = self.parts[target]
        a = torch.stack([e.lora_A for e in experts]).transpose(1, 2).contiguous()  # [E, in, r]
        b = torch.stack([e.lora_B for e in experts]).transpose(1, 2).contiguous()  # [E, r, out]
        if target == FC1:
            a = summed_grad(a, self.mlp_groups[0])
        else:
            b = summed_grad(b, self.mlp_groups[0])
        x = F.dropout(x, self.dropout, self.training) if self.dropout else x
        h = grouped_matmul(x, a, tokens_per_expert)
        return out + grouped_matmul(h, b, tokens_per_expert) * self.scale

    def sharded(self, prefix: str, sharded_offsets: tuple, metadata: dict | None) -> dict:
        """The adapters' sharded tensors under the keys (and expert axis) of ``SequentialMLP``'s:
        ``{prefix}experts.linear_fc1.lora_A`` stacked over the global experts."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        single = (metadata or {}).get("singleton_local_shards", False)
        tp_group, dp_group = self.mlp_groups
        out: dict = {}
        for target, experts in self.parts.items():
            for i, adapter in enumerate(experts):
                g = self.first + i
                local = f"{prefix}lora_adapters.{target}.{i}."
                if single:
                    shared, offsets = f"{prefix}experts.{g}.{target}.", sharded_offsets
                else:
                    shared = f"{prefix}experts.{target}."
                    offsets = (*sharded_offsets, (len(sharded_offsets), g, self.n_global))
                column = target == FC1
                gated = column and self.gated
                sd = adapter_shards(adapter, local, offsets, metadata, column, tp_group, gated)
                replace_prefix_for_sharding(sd, local, shared)
                for sh in sd.values():  # replicated along the expert-data-parallel group
                    sh.replica_id = (*sh.replica_id[:2], dp_group.rank())
                out.update(sd)
        return out


def attach_grouped(mlp: torch.nn.Module, key: str, targets: list[str], lora: Any) -> None:
    """Give ``mlp`` (a ``GroupedMLP``) per-expert adapters on ``targets`` and a sharded state
    dict that saves them beside its weights."""
    adapters = GroupedAdapters(mlp, key, targets, lora)
    base = mlp.sharded_state_dict

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        # Megatron's GroupedMLP reads every tensor of its state dict as weight1 or weight2
        mods = mlp._modules
        mods.pop("lora_adapters")
        try:
            out = base(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        finally:
            mods["lora_adapters"] = adapters
        out.update(adapters.sharded(prefix, sharded_offsets, metadata))
        return out

    mlp.lora_adapters = adapters
    mlp.sharded_state_dict = sharded_state_dict
