"""Megatron checkpoints: dist_checkpointing (``torch_dist``) and Megatron-LM's legacy layout.

torch_dist: ``<dir>/latest_checkpointed_iteration.txt`` = ``release`` and ``<dir>/release/`` a
``dist_checkpointing`` checkpoint of ``{"model": GPTModel.sharded_state_dict(), "iteration": 0,
"checkpoint_version": 3.0, "anyspeed_model": preset.to_dict(), "anyspeed_convert": {...}}``. The
keys come from Megatron-Core's own GPTModel (built empty, at TP1/PP1, by the one builder), so
the checkpoint loads at any TP/PP layout. Reading loads one layer at a time.

legacy: ``<dir>/iter_0000001/mp_rank_XX[_YYY]/model_optim_rng.pt`` per target TP (XX) / PP (YYY)
rank, holding the rank's GPTModel ``state_dict()`` (local layer numbers per stage, ``_extra_state``
entries included) so Megatron-LM's loader takes it with ``strict=True``.

Both layouts as Megatron-LM's ``pretrain_gpt.py`` writes them are read too. Where a checkpoint
is, its format, common state and model record: :mod:`anyspeed.checkpoint` (every pickle through
:mod:`anyspeed.safe_pickle`).
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from anyspeed.checkpoint.files import iteration_dir, legacy_ranks, rank_dir_name, write_tracker
from anyspeed.checkpoint.reads import torch_load
from anyspeed.checkpoint.record import model_record
from anyspeed.convert.engine import EMBED, HEAD, Group
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.mapped import FileSink
from anyspeed.distributed.resharding import (
    LAYER,
    LOCAL_EXPERT,
    Stacked,
    materialize,
    merge_tp,
    shard_shape,
    shard_tp,
    tp_parts,
    tp_rule,
)
from anyspeed.models.config import ModelConfig

LEGACY_ITERATION = 1
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(transformer_layer\.)?")


def common_state(preset: ModelConfig, iteration: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "iteration": iteration,
        "checkpoint_version": 3.0,
        **model_record(preset),
        "anyspeed_convert": extra,
    }


def legacy_expert_parallel(common: dict[str, Any]) -> int:
    """The EP size a legacy checkpoint was saved with (anyspeed's record, or Megatron-LM's
    args; 1 when neither says)."""
    mine = (common.get("anyspeed_convert") or {}).get("expert_model_parallel_size")
    args = common.get("args")
    return int(mine or getattr(args, "expert_model_parallel_size", None) or 1)


def _holds(name: str, x: int, per_rank: int) -> bool:
    """Whether EP rank ``x`` (of ``per_rank`` experts each) holds full-model tensor ``name``."""
    mt = LOCAL_EXPERT.search(name)
    return mt is None or x * per_rank <= int(mt.group(2)) < (x + 1) * per_rank


def _expert_slice(names: list[str], x: int, per_rank: int) -> dict[str, str]:
    """Full-model name -> rank ``x``'s name, for the tensors EP rank ``x`` holds (its experts
    renumbered from 0, everything else as is)."""
    out = {}
    for n in names:
        mt = LOCAL_EXPERT.search(n)
        if mt is None:
            out[n] = n
        elif _holds(n, x, per_rank):
            local = int(mt.group(2)) - x * per_rank
            out[n] = n[: mt.start()] + f"{mt.group(1)}{local}." + n[mt.end() :]
    return out


# ------------------------------------------------------------------- Megatron in one process
@contextlib.contextmanager
def megatron_session() -> Iterator[None]:
    """A one-rank process group and Megatron parallel state (TP1/PP1) to build GPTModel in."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if dist.is_initialized():
        tp1 = ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() == 1
        if dist.get_world_size() == 1 and tp1 and ps.get_pipeline_model_parallel_world_size() == 1:
            yield
            return
        raise ConvertError(
            "convert in its own process: this one already runs a "
            f"{dist.get_world_size()}-rank process group"
        )
    from anyspeed import adaptor

    ours = adaptor.state() is None  # (a caller's own adaptor stays as it is)
    adaptor.apply(argv=[])
    # An in-memory store: a rendezvous file's removal at the end can wait behind the
    # conversion's own writes (0.6 s measured after 3.7 GB).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ps.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        if ours:  # an in-process conversion leaves Megatron as it found it
            adaptor.undo()


def empty_model(preset: ModelConfig, dtype: torch.dtype):
    """GPTModel (the one builder, TP1/PP1) with uninitialised weights: its sharded state dict
    is the checkpoint's key layout."""
    from anyspeed.models import gpt

    with warnings.catch_warnings():  # advice on routing numerics, for a model that never runs
        warnings.filterwarnings("ignore", "Using a large number of experts", UserWarning)
        cfg = gpt.transformer_config(
            preset,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            perform_initialization=False,
        )
    return gpt.build(preset, cfg)


# ----------------------------------------------------------------------------------- legacy
def _extra_states(names: list[str], last_stage: bool) -> dict[str, None]:
    """The ``_extra_state`` entries Megatron's linear layers add to a state dict."""
    mods = {
        n.rsplit(".", 1)[0]
        for n in names
        if ".linear_" in n or ".eh_proj." in n or n.startswith("output_layer")
    }
    if last_stage:
        mods.add("output_layer")
    return {f"{m}._extra_state": None for m in sorted(mods)}


def save_legacy(
    out_dir: Path,
    preset: ModelConfig,
    tp: int,
    stage_layers: list[int],
    stage_groups: Callable[..., Iterator[dict[str, torch.Tensor | Stacked]]],
    common: dict,
    ep: int = 1,
) -> None:
    """Megatron-LM's ``iter_0000001/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``, one tensor at
    a time (EP rank ``E`` holding its experts, numbered from 0, and everything else).

    Each rank file is first written by ``torch.save`` with its tensors as untouched
    placeholders and ``skip_data`` (the archive with room for every tensor), then each
    tensor's shard is produced from ``stage_groups(stage, keep)`` (lazy views of the source
    tensors ``keep`` accepts: an EP rank reads only its experts) and written into its record:
    nothing of a stage is held, and mapped source bytes go file to file. Rank files are written
    in parallel threads.
    """
    from concurrent.futures import ThreadPoolExecutor

    it_dir = Path(iteration_dir(out_dir, LEGACY_ITERATION))
    pp = len(stage_layers)
    per_rank = (preset.num_experts or 0) // ep

    def local(name: str, s: int) -> str:
        if mt := LAYER.match(name):
            first = sum(stage_layers[:s])
            return f"decoder.layers.{int(mt.group(1)) - first}." + name[mt.end() :]
        return name

    def rank_tensors(s: int, x: int) -> Iterator[tuple[str, torch.Tensor | Stacked]]:
        """(name in the rank file, full tensor) of stage ``s`` for EP rank ``x``."""
        for group in stage_groups(s, lambda n: _holds(n, x, per_rank)):
            names = _expert_slice(list(group), x, per_rank)
            for n, t in group.items():
                if n in names:
                    yield local(names[n], s), t

    def save_rank(s: int, r: int, x: int) -> None:
        shapes = {n: (shard_shape(n, tuple(t.shape), tp), t.dtype) for n, t in rank_tensors(s, x)}
        model: dict[str, torch.Tensor | None] = {
            n: torch.empty(shape, dtype=dtype) for n, (shape, dtype) in shapes.items()
        }
        model.update(_extra_states(list(shapes), s == pp - 1))
        rank_dir = it_dir / rank_dir_name(r, s, x, pp, ep)
        rank_dir.mkdir(parents=True)
        path = rank_dir / "model_optim_rng.pt"
        with torch.serialization.skip_data():
            torch.save({"model": model, **common}, path)
        del model
        records = torch._C.PyTorchFileReader(str(path))
        if f"data/{len(shapes)}" in records.get_all_records():
            raise ConvertError("internal: the common state of a legacy checkpoint holds tensors")
        offsets = {n: records.get_record_offset(f"data/{i}") for i, n in enumerate(shapes)}
        del records
        with FileSink(path, truncate=False) as f:
            for n, t in rank_tensors(s, x):
                shard = shard_tp(n, t, tp, r, tp_parts(n, preset))
                if (tuple(shard.shape), shard.dtype) != shapes[n]:
                    raise ConvertError(f"internal: {n} changed between the two passes")
                f.seek(offsets[n])
                f.write_tensor(shard)

    tasks = [(s, r, x) for s in range(pp) for r in range(tp) for x in range(ep)]
    # copy_file_range, pwrite and torch ops release the GIL: the ranks are written in parallel.
    with ThreadPoolExecutor(min(len(tasks), 4)) as pool:
        list(pool.map(lambda task: save_rank(*task), tasks))
    write_tracker(out_dir, LEGACY_ITERATION)


def read_legacy(
    it_dir: Path, ep: int = 1, preset: ModelConfig | None = None
) -> Iterator[tuple[Group, dict[str, torch.Tensor | Stacked]]]:
    """Full Megatron tensors (TP shards merged, EP ranks' experts renumbered globally, global
    layer numbers) one group at a time; ``ep``: the EP size it was saved with; ``preset``: the
    model (its tensors TP splits part by part)."""
    ranks = legacy_ranks(it_dir, ep > 1)
    if not ranks:
        raise ConvertError(f"{it_dir}: no mp_rank_* rank files")
    tp = 1 + max(t for t, _, _ in ranks)
    pp = 1 + max(p for _, p, _ in ranks)
    ep = 1 + max(x for _, _, x in ranks)
    want = [(t, p, x) for t in range(tp) for p in range(pp) for x in range(ep)]
    missing = [rank_dir_name(*k, pp, ep) for k in want if k not in ranks or not ranks[k].is_file()]
    if missing:
        raise ConvertError(f"{it_dir}: missing rank files {', '.join(missing)}")
    offset = 0
    for s in range(pp):
        shards = {
            (t, x): torch_load(ranks[(t, s, x)])["model"] for t in range(tp) for x in range(ep)
        }  # fmt: skip  (memory-mapped)
        sources = _stage_sources(shards, tp, ep)
        by_group = _by_group(sources, first_stage=s == 0)
        layers = sorted(g for g in by_group if isinstance(g, int))
        mtp = sorted(g for g in by_group if isinstance(g, tuple))
        order = [
            *([EMBED] if EMBED in by_group else []),
            *layers,
            *mtp,
            *([HEAD] if HEAD in by_group else []),
        ]
        for g in order:
            out = {}
            for n in by_group[g]:
                x, local = sources[n]
                full = merge_tp(n, [shards[(t, x)][local] for t in range(tp)], tp_parts(n, preset))
                if isinstance(g, int):
                    n = f"decoder.layers.{g + offset}." + n[LAYER.match(n).end() :]
                out[n] = full
            if isinstance(g, tuple):  # MTP layer j: the group after the decoder's layers
                yield offset + len(layers) + g[0], out
            else:
                yield (g + offset if isinstance(g, int) else g), out
        offset += len(layers)
        del shards


def read_fsdp_dtensor(it_dir: Path, tp: int) -> Iterator[tuple[Group, dict[str, torch.Tensor]]]:
    """A Megatron-FSDP run's checkpoint (:mod:`anyspeed.checkpoint.fsdp_dtensor`, saved at
    tensor-parallel size ``tp``) as :func:`read_legacy`'s groups: whole tensors, in order."""
    tensors = dict(_fsdp_dtensor_tensors(it_dir, tp))
    by_group = _by_group(dict.fromkeys(tensors), first_stage=True)
    layers = sorted(g for g in by_group if isinstance(g, int))
    for g in [*([EMBED] if EMBED in by_group else []), *layers, HEAD]:
        yield g, {n: tensors[n] for n in by_group.get(g, [])}


def _fsdp_dtensor_tensors(it_dir: Path, tp: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's whole tensors by bare name (anyspeed's ``model.<name>``, Megatron-LM's
    ``model.module.<name>``), read through the checked DCP reader; a SwiGLU ``linear_fc1`` saved
    at TP ``tp`` (each TP rank's gate and up rows in turn) reordered as at TP1."""
    from anyspeed.convert.dcp_io import DcpReader
    from anyspeed.distributed.dtensors import bare

    reader = DcpReader(it_dir)
    for key in sorted(k for k, md in reader.tensors.items() if hasattr(md, "chunks")):
        if not key.startswith("model."):
            continue
        shape = reader.shape(key)
        name, t = (
            bare(key[len("model.") :]),
            materialize(reader.read(key, (0,) * len(shape), shape)),
        )
        if tp > 1 and tp_rule(name) == "swiglu":
            t = materialize(merge_tp(name, list(t.chunk(tp, dim=0))))
        yield name, t


def _by_group(sources: dict[str, tuple], first_stage: bool) -> dict[Any, list[str]]:
    """A stage's names by group: its (local) layer number, ``(j,)`` for MTP layer ``j``, the
    embedding or the head. The embedding copy a later stage keeps for MTP is left out."""
    by_group: dict[Any, list[str]] = {}
    for n in sources:
        if mt := LAYER.match(n):
            by_group.setdefault(int(mt.group(1)), []).append(n)
        elif mt := MTP_LAYER.match(n):
            by_group.setdefault((int(mt.group(1)),), []).append(n)
        elif n.startswith("embedding."):
            if first_stage:
                by_group.setdefault(EMBED, []).append(n)
        else:
            by_group.setdefault(HEAD, []).append(n)
    return by_group


def _stage_sources(shards: dict[tuple[int, int], dict], tp: int, ep: int) -> dict[str, tuple]:
    """Stage-local name (experts numbered globally) -> (EP rank, name in that rank's file)."""
    per_rank = None
    out: dict[str, tuple[int, str]] = {}
    for x in range(ep):
        for n, v in shards[(0, x)].items():
            if not isinstance(v, torch.Tensor):
                continue
            mt = LOCAL_EXPERT.search(n)
            if mt is None:
                out.setdefault(n, (0, n))
                continue
            if per_rank is None:
                per_rank = 1 + max(
                    int(m.group(2)) for k in shards[(0, x)] if (m := LOCAL_EXPERT.search(k))
                )
            glob = x * per_rank + int(mt.group(2))
            out[n[: mt.start()] + f"{mt.group(1)}{glob}." + n[mt.end() :]] = (x, n)
    return out


def json_config(common: dict) -> dict | None:
    text = (common.get("anyspeed_convert") or {}).get("hf_config_json")
    return json.loads(text) if text else None
