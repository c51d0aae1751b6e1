"""LoRA on Megatron's tensor-parallel layers, as a model transform applied before DDP.

Each target ``ColumnParallelLinear`` / ``RowParallelLinear`` keeps its own parameters and names
and gains two more, ``lora_A`` [r, in] and ``lora_B`` [out, r], sharded as the layer is: a
column layer's ``lora_A`` is replicated and its ``lora_B`` split along the output like its
weight; a row layer's ``lora_A`` is split along the input and its ``lora_B`` replicated. The
adapter output ``(alpha / r) * B A x`` is added by a forward hook, with the same tensor/sequence
parallel communication as the layer (on the rank-r activations, which are small). ``lora_A``
is drawn from a generator seeded by (seed, global layer, module), full-size, and this rank's
shard taken, so every TP layout starts from the same adapters; ``lora_B`` starts at zero, so
the adapted model is the base model until it trains.

Written here rather than through PEFT's Megatron backend: PEFT wraps each layer under
``base_layer`` (renaming every parameter, so Megatron's distributed checkpoints of the base model
no longer load) and initialises the replicated ``lora_A`` per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from anyspeed.errors import UsageError
from anyspeed.models.lora import ADAPTER, MLA_QKV, MLA_TARGETS, TARGETS, LoraRecord
from anyspeed.training import lora_experts as experts

VIEWS = ("all", "base", "adapters", "weights")
GROUPED = "experts"  # the target name _layers gives a GroupedMLP (fc1 and fc2 in one module)


def _layers(chunk: torch.nn.Module):
    """(global key, target, module) of every linear layer in ``chunk``'s transformer layers
    (a sequential expert's by its global expert index) and of every ``GroupedMLP``
    (target ``experts``)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import GroupedMLP

    from anyspeed.models.mla import DuplicatedLinear

    linear = (ColumnParallelLinear, RowParallelLinear, DuplicatedLinear)
    for layer in chunk.decoder.layers:
        for name, mod in layer.named_modules():
            if isinstance(mod, linear):
                key = f"{layer.layer_number}.{experts.global_name(layer, name)}"
                yield key, name.rsplit(".", 1)[-1], mod
            elif isinstance(mod, GroupedMLP):
                yield f"{layer.layer_number}.{name}", GROUPED, mod


def _init_a(key: str, r: int, fan_in: int, seed: int) -> torch.Tensor:
    """The full ``lora_A`` of one layer: uniform(+-1/sqrt(in)) (nn.Linear's default), drawn
    from a generator seeded by the seed and the layer's global key."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(r, fan_in, generator=g, dtype=torch.float64) * 2 - 1).mul(bound)


def _attach(
    mod: torch.nn.Module, key: str, r: int, scale: float, dropout: float, seed: int
) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as tpl

    # MLA's KV down-projection at TP > 1 (models/mla.py): every rank holds the whole weight
    whole = not isinstance(mod, (tpl.ColumnParallelLinear, tpl.RowParallelLinear))
    column = whole or isinstance(mod, tpl.ColumnParallelLinear)
    expert = bool(getattr(mod, "is_expert", False))
    group = ps.get_tensor_model_parallel_group() if whole else mod.tp_group  # experts': ETP
    tp, rank = (1, 0) if whole else (group.size(), group.rank())
    out_local, in_local = mod.weight.shape
    fan_in = in_local if column else in_local * tp
    a = _init_a(key, r, fan_in, seed)
    if not column:
        a = a.chunk(tp, dim=1)[rank]
    dtype, dev = mod.weight.dtype, mod.weight.device
    mod.lora_A = torch.nn.Parameter(a.to(dtype).to(dev).contiguous())
    mod.lora_B = torch.nn.Parameter(torch.zeros(out_local, r, dtype=dtype, device=dev))
    sharded, replicated = (mod.lora_B, mod.lora_A) if column else (mod.lora_A, mod.lora_B)
    if expert:
        experts.mark(sharded, mod.weight, True, 0 if column else 1)
        experts.mark(replicated, mod.weight, tp == 1, 1 if column else 0)
    elif whole:  # as the weight: under SP each rank's own tokens, the gradients summed over TP
        for p in (mod.lora_A, mod.lora_B):
            p.sequence_parallel = mod.config.sequence_parallel
    else:
        tpl.set_tensor_model_parallel_attributes(sharded, True, 0 if column else 1, 1)
        # Each rank sees only its sequence shard under SP: the replicated factor's gradient is
        # partial and must be summed over TP (Megatron does so for params tagged like this).
        replicated.sequence_parallel = mod.config.sequence_parallel
    mod.lora_scale = scale
    mod.lora_key = key
    mod.lora_dropout = dropout
    mod.lora_column = column
    mod.lora_expert = expert
    mod.lora_whole = whole
    mod.register_forward_hook(_hook)
    base = mod.sharded_state_dict

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """The layer's sharded state dict with the adapters sharded as they are held."""
        out = base(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        # A gated fc1 holds [gate shard; up shard] per rank: its lora_B is saved as Megatron
        # saves the weight (global [gate; up]), so the checkpoint reshards and merges alike.
        gated = column and mod.config.gated_linear_unit and key.endswith("linear_fc1")
        shards = experts.adapter_shards(
            mod, prefix, sharded_offsets, metadata, column, group, gated, split=not whole
        )
        out.update(shards)
        return out

    mod.sharded_state_dict = sharded_state_dict


def _comm(column: bool, sequence_parallel: bool) -> Callable:
    """The collective on the rank-r activations: a column layer's input is replicated (or
    sequence-sharded under SP), a row layer's product is a partial sum over input shards."""
    from megatron.core import tensor_parallel as tpl

    if column:
        if sequence_parallel:
            return tpl.gather_from_sequence_parallel_region
        return tpl.copy_to_tensor_model_parallel_region
    if sequence_parallel:
        return tpl.reduce_scatter_to_sequence_parallel_region
    return tpl.reduce_from_tensor_model_parallel_region


def _hook(mod: torch.nn.Module, args: tuple, output: tuple) -> tuple:
    """Add ``scale * B A x`` to the layer's output (its bias, if returned apart, unchanged)."""
    if getattr(mod, "lora_off", False):
        return output
    x = F.dropout(args[0], mod.lora_dropout, mod.training) if mod.lora_dropout else args[0]
    a, b = mod.lora_A, mod.lora_B
    if mod.lora_expert:  # the dispatcher gathers the tokens and reduces the outputs
        if mod.lora_column:
            a = experts.summed_grad(a, mod.tp_group)
        else:
            b = experts.summed_grad(b, mod.tp_group)
    if mod.lora_expert or mod.lora_whole:  # no communication of the layer's own
        return (output[0] + F.linear(F.linear(x, a), b) * mod.lora_scale, *output[1:])
    # the layer's own flag: decoding switches sequence parallelism off and back
    comm = _comm(mod.lora_column, bool(getattr(mod, "sequence_parallel", False)))
    h = comm(F.linear(x, a))
    return (output[0] + F.linear(h, b) * mod.lora_scale, *output[1:])


def _is_kept(key: str, keep: tuple[str, ...]) -> bool:
    return ADAPTER in key or any(f"{m}." in key or key.startswith(m) for m in keep)


def _views(chunk: torch.nn.Module, keep: tuple[str, ...]) -> None:
    """``chunk.lora_view``: "adapters" (the default) saves and loads only the adapters and the
    modules to save, "base" only the rest, "weights" all but the adapters (a start from a
    checkpoint that holds the modules to save, e.g. a reward head), "all" everything."""
    full_sharded, full_load = chunk.sharded_state_dict, chunk.load_state_dict
    chunk.lora_view = "adapters"

    def part(key: str) -> bool:
        kept = _is_kept(key, keep)
        views = {"all": True, "adapters": kept, "base": not kept, "weights": ADAPTER not in key}
        return views[chunk.lora_view]

    def sharded_state_dict(prefix: str = "", *args: Any, **kwargs: Any) -> dict:
        out = full_sharded(prefix, *args, **kwargs)
        return {k: v for k, v in out.items() if part(k)}

    def load_state_dict(state: dict, strict: bool = True):
        res = full_load(state, strict=False)
        missing = [k for k in res.missing_keys if part(k) and not k.endswith("_extra_state")]
        if strict and (missing or res.unexpected_keys):
            raise RuntimeError(
                f"LoRA {chunk.lora_view} load: missing {missing[:3]}, "
                f"unexpected {res.unexpected_keys[:3]}"
            )
        return res

    chunk.sharded_state_dict = sharded_state_dict
    chunk.load_state_dict = load_state_dict


@dataclass(frozen=True)
class _GroupedSpec:
    """What a ``GroupedMLP``'s adapters need of the run's LoRA settings."""

    r: int
    scale: float
    dropout: float
    init_a: Callable[[str, int, int], torch.Tensor]


def apply_lora(
    chunk: torch.nn.Module,
    targets: list[str],
    r: int,
    alpha: float,
    dropout: float = 0.0,
    seed: int = 1234,
    modules_to_save: tuple[str, ...] = (),
) -> torch.nn.Module:
    """Freeze ``chunk`` except ``modules_to_save`` and add adapters on ``targets`` (of its
    ``language_model``'s layers when it has one: a vision-language model's tower takes none)."""
    for name, p in chunk.named_parameters():
        p.requires_grad = any(f"{m}." in name or name.startswith(m) for m in modules_to_save)
    found: set[str] = set()
    shared: dict[int, torch.nn.Parameter] = {}  # layer -> the A of its MLA linear_qkv adapter
    lm = getattr(chunk, "language_model", chunk)  # a vision-language model: its language model
    for key, short, mod in list(_layers(lm)):
        if short == GROUPED and {"linear_fc1", "linear_fc2"} & set(targets):
            spec = _GroupedSpec(r, alpha / r, dropout, lambda k, n, fan: _init_a(k, n, fan, seed))
            experts.attach_grouped(mod, key, targets, spec)
            found |= {"linear_fc1", "linear_fc2"} & set(targets)
        elif short in targets:
            _attach(mod, key, r, alpha / r, dropout, seed)
            found.add(short)
        elif short in MLA_QKV and "linear_qkv" in targets:  # one fused adapter, A shared
            layer = int(key.split(".", 1)[0])
            _attach(mod, f"{layer}.self_attention.linear_qkv", r, alpha / r, dropout, seed)
            mod.lora_A = shared.setdefault(layer, mod.lora_A)
            found.add("linear_qkv")
    if not found and lm.decoder.layers:  # (a pipeline stage may lack some: Qwen3-Next's)
        raise ValueError(f"--lora-target-modules: no layer of {targets} in this model")
    _views(chunk, tuple(modules_to_save))
    return chunk


def set_view(model: list[torch.nn.Module], view: str) -> None:
    """Which part of every chunk (DDP and precision wrappers included) checkpoints see."""
    for m in model:
        while not hasattr(m, "lora_view") and hasattr(m, "module"):
            m = m.module
        m.lora_view = view


@dataclass(frozen=True)
class LoRAConfig:
    """The LoRA flags of a run, checked."""

    target_modules: tuple[str, ...]
    r: int
    alpha: float
    dropout: float
    modules_to_save: tuple[str, ...]
    load: str | None  # --lora-load: adapters (optimizer, position) to start from
    seed: int

    def record(self) -> LoraRecord:
        """What a LoRA checkpoint records, so a mismatched --lora-load is refused up front."""
        return LoraRecord.of(self.r, self.alpha, self.target_modules)

    def transform(self) -> Callable:
        """The model transform adding these adapters (applied before DDP)."""

        def transform(chunk: torch.nn.Module, model: Any) -> torch.nn.Module:
            return apply_lora(
                chunk,
                list(self.target_modules),
                self.r,
                self.alpha,
                self.dropout,
                self.seed,
                self.modules_to_save,
            )

        return transform


def from_args(args: argparse.Namespace) -> LoRAConfig | None:
    """The checked LoRA flags of ``args`` (None without --lora-target-modules); UsageError on
    an unknown target, bad sizes or a --lora-load that does not fit."""
    if not args.lora_target_modules:
        flags = (
            ("--lora-load", args.lora_load),
            ("--lora-r", args.lora_r),
            ("--lora-alpha", args.lora_alpha),
            ("--lora-dropout", args.lora_dropout),
            ("--lora-modules-to-save", args.lora_modules_to_save),
        )
        given = [f for f, v in flags if v is not None and v != []]
        if given:  # else the run would silently be full fine-tuning
            raise UsageError(
                f"{given[0]} needs --lora-target-modules (the layers to adapt, of "
                f"{' '.join(TARGETS)}); without it the run is full fine-tuning"
            )
        return None
    bad = [t for t in args.lora_target_modules if t not in TARGETS]
    if bad:
        raise UsageError(
            f"--lora-target-modules {bad[0]!r} is not a layer of this model; "
            f"choose from {' '.join(TARGETS)}"
        )
    mla = bool(getattr(args, "multi_latent_attention", False))
    fused = [t for t in args.lora_target_modules if t in MLA_QKV]
    if mla and fused and "linear_qkv" in args.lora_target_modules:
        raise UsageError(
            f"--lora-target-modules linear_qkv and {fused[0]}: on multi-latent attention "
            "linear_qkv is MindSpeed-LLM's fused down-projection adapter, which already adapts "
            f"{fused[0]}; give one of them"
        )
    absent = [t for t in args.lora_target_modules if t in MLA_TARGETS]
    if absent and not mla:
        raise UsageError(
            f"--lora-target-modules {absent[0]}: a layer of multi-latent attention, which this "
            "model does not have (adapt linear_qkv)"
        )
    low_rank = bool(getattr(args, "q_lora_rank", None))  # else one query projection
    queries = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj")
    query = [t for t in absent if t in queries and (t == "linear_q_proj") == low_rank]
    if mla and query:
        have = "--q-lora-rank" if low_rank else "no --q-lora-rank"
        raise UsageError(f"--lora-target-modules {query[0]}: this model ({have}) has no such layer")
    r = 16 if args.lora_r is None else args.lora_r
    alpha = 32.0 if args.lora_alpha is None else args.lora_alpha
    dropout = 0.0 if args.lora_dropout is None else args.lora_dropout
    if r < 1 or alpha <= 0 or not 0 <= dropout < 1:
        raise UsageError("--lora-r must be >= 1, --lora-alpha > 0 and --lora-dropout in [0, 1)")
    cfg = LoRAConfig(
        tuple(args.lora_target_modules),
        r,
        alpha,
        dropout,
        tuple(args.lora_modules_to_save),
        args.lora_load,
        args.seed,
    )
    if cfg.load:
        _check_lora_load(cfg)
    return cfg


@contextlib.contextmanager
def adapters_off(model: list[torch.nn.Module]) -> Iterator[None]:
    """Run ``model`` as its base inside the block: every adapter adds nothing (the frozen
    reference of a LoRA run, without a second copy of the weights)."""
    mods = [m for chunk in model for m in chunk.modules() if hasattr(m, "lora_key")]
    for m in mods:
        m.lora_off = True
    try:
        yield
    finally:
        for m in mods:
            m.lora_off = False


def _check_lora_load(cfg: LoRAConfig) -> None:
    from anyspeed.checkpoint.checks import verify
    from anyspeed.checkpoint.reads import read_common, tracked_dir

    try:
        path = tracked_dir(cfg.load)
        common = read_common(path) if path else None
        if path:
            verify(path)  # every file the load reads: there, whole and readable
    except (OSError, ValueError) as exc:  # CheckpointFileError is a ValueError
        raise UsageError(f"--lora-load {cfg.load!r}: {exc}") from None
    if common is None:
        raise UsageError(f"--lora-load {cfg.load!r}: not a checkpoint directory")
    saved = LoraRecord.from_common(common)
    if saved is None:
        raise UsageError(
            f"--lora-load {cfg.load!r} is not a LoRA checkpoint "
            "(saved without --lora-target-modules)"
        )
    wrong = saved.mismatch(r=cfg.r, alpha=cfg.alpha, target_modules=list(cfg.target_modules))
    if wrong:
        flag = wrong.split()[0]
        raise UsageError(f"--lora-load {cfg.load!r} was trained with {wrong}; pass the same {flag}")
