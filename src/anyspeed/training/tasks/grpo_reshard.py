"""GRPO's rollout at another layout than training: the whole model (tensor- and
pipeline-parallel size 1) on every rank, each rank sampling its share of its replica's
sequences, so the rollout runs at TP 1 x DP (world size) whatever the training layout.

Before each rollout the weights move in memory from the training model: tensor-parallel shards
are all-gathered and joined as the checkpoint converter joins them (:func:`merge_tp`, fused
parts included; LoRA adapters as their layer's weight), expert-parallel ranks all-gather their
experts and pipeline stages broadcast their layers (both renumbered globally) to every rank.
The rollout model's tensors are then the gathered training model's, bit for bit. Megatron
reads its process groups from ``parallel_state`` when it runs, so the rollout model is built
and run inside a second, complete set of those globals made for TP 1 / PP 1
(:class:`ParallelStates`); the training model keeps the groups it was built with.

MindSpeed-RL's names: ``--infer-tensor-parallel-size 1 --infer-pipeline-parallel-size 1
--infer-expert-parallel-size 1``.
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch

_GLOBAL = re.compile(r"_[A-Z][A-Z0-9_]*$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_ADAPTER = re.compile(r"\.lora_[AB]$")
_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")  # Megatron's SequentialMLP


def _ps_globals() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {k: v for k, v in vars(ps).items() if _GLOBAL.match(k)}


class ParallelStates:
    """Megatron's parallel-state globals for training (as they are) and for a TP 1 / PP 1
    rollout (made here, every rank taking part), swapped in place by :meth:`rollout`."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        from anyspeed.training.distributed import _timeout

        self.train = _ps_globals()
        for k, v in self.train.items():
            setattr(ps, k, {} if isinstance(v, dict) else None)
        try:
            ps.initialize_model_parallel(distributed_timeout_minutes=_timeout["minutes"])
            self.roll = _ps_globals()
        finally:
            vars(ps).update(self.train)

    @contextlib.contextmanager
    def rollout(self) -> Iterator[None]:
        """The rollout's parallel state inside the block, training's after it."""
        from megatron.core import parallel_state as ps

        vars(ps).update(self.roll)
        try:
            yield
        finally:
            vars(ps).update(self.train)


@contextlib.contextmanager
def _same_rng() -> Iterator[None]:
    """Every generator as it was (building a model draws initial weights): a run with a
    rollout layout consumes the same random numbers as one without."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from anyspeed.device import detect

    info = detect()
    dev = None if info.is_cpu else getattr(torch, info.type, None)
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate(),
             get_cuda_rng_tracker().get_states(), dev.get_rng_state() if dev else None)  # fmt: skip
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
        get_cuda_rng_tracker().set_states(saved[3])
        if dev is not None:
            dev.set_rng_state(saved[4])


def _tensors(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    from anyspeed.training.step import unwrap

    return {n: t.detach() for n, t in unwrap(chunk).state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor) and not n.endswith("_extra_state")}  # fmt: skip


def _global_names(chunk: torch.nn.Module) -> dict[int, int]:
    """This chunk's local decoder layer index -> global index."""
    from anyspeed.training.step import unwrap

    decoder = getattr(unwrap(chunk), "decoder", None)
    layers = getattr(decoder, "layers", [])
    return {i: layer.layer_number - 1 for i, layer in enumerate(layers)}


class RolloutModel:
    """The whole model on every rank, synced from the trainer before each rollout."""

    def __init__(self, trainer: Any) -> None:
        from anyspeed.layout import Layout
        from anyspeed.training.model_pipeline import build_chunks

        self.states = ParallelStates()
        with _same_rng(), self.states.rollout():  # the task's transforms: LoRA's adapters
            chunks, _ = build_chunks(trainer.model_config, Layout(), trainer.cfg,
                                     trainer.task.transforms(), trainer.task.build)  # fmt: skip
        self.chunks = [c.eval().requires_grad_(False) for c in chunks]
        self.targets = _tensors(self.chunks[0])
        self.preset = trainer.model_config
        self.synced_at: int | None = None

    def sync(self, trainer: Any) -> float:
        """Move the trainer's weights in (once per optimizer step); seconds taken."""
        if self.synced_at == trainer.iteration:
            return 0.0
        t0 = time.perf_counter()
        with torch.no_grad():
            filled = self._broadcast_stages(self._gather_stage(trainer))
        left = [n for n in self.targets if n not in filled and not n.startswith("mtp.")]
        if left:
            raise RuntimeError(f"rollout model: no training tensor for {left[:3]}")
        self.synced_at = trainer.iteration
        return time.perf_counter() - t0

    def _gather_stage(self, trainer: Any) -> dict[str, torch.Tensor]:
        """This rank's stage's tensors, whole (tensor-parallel shards joined), by global name."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        ep, ep_group = (
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_model_parallel_group(),
        )
        groups = {False: ps.get_tensor_model_parallel_group(),
                  True: ps.get_expert_tensor_parallel_group()}  # fmt: skip
        out: dict[str, torch.Tensor] = {}
        for chunk in trainer.model:
            numbers = _global_names(chunk)
            for name, t in _tensors(chunk).items():
                if m := _LAYER.match(name):
                    name = f"decoder.layers.{numbers[int(m.group(1))]}." + name[m.end() :]
                want = self.targets.get(name)
                if want is None:  # e.g. the tied output weight's copy on the last stage
                    continue
                expert = _EXPERT.search(name)
                t = self._whole(name, t, want.shape, groups[expert is not None])
                if expert is None or ep == 1:
                    out[name] = t
                    continue
                # experts: this rank's are local_experts.0..n-1; EP rank x holds x*n .. x*n+n-1
                parts = [torch.empty_like(t) for _ in range(ep)]
                dist.all_gather(parts, t.contiguous(), group=ep_group)
                n, i = (self.preset.num_experts or 0) // ep, int(expert.group(2))
                for x, part in enumerate(parts):
                    head, tail = name[: expert.start()], name[expert.end() :]
                    out[f"{head}{expert.group(1)}{x * n + i}.{tail}"] = part
        return out

    def _whole(self, name: str, t: torch.Tensor, shape: torch.Size, group: Any) -> torch.Tensor:
        """``t`` whole: its tensor-parallel shards over ``group`` all-gathered and joined as the
        checkpoint converter joins them; ``t`` itself where it is not split."""
        import torch.distributed as dist

        from anyspeed.convert.engine import merge_tp
        from anyspeed.convert.fused import materialize, tp_parts

        size = dist.get_world_size(group)
        if size == 1 or shape == t.shape:
            return t
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        rule = _ADAPTER.sub(".weight", name)  # an adapter is split as its layer
        return materialize(merge_tp(rule, parts, tp_parts(rule, self.preset)))

    def _broadcast_stages(self, mine: dict[str, torch.Tensor]) -> set[str]:
        """Every stage's tensors into the rollout model on every rank of the pipeline."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        for name, t in mine.items():
            self.targets[name].copy_(t)
        pp = ps.get_pipeline_model_parallel_world_size()
        if pp == 1:
            return set(mine)
        group, me = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
        names: list[Any] = [None] * pp
        dist.all_gather_object(names, sorted(mine), group=group)
        ranks = dist.get_process_group_ranks(group)
        for stage, stage_names in enumerate(names):
            for name in stage_names:
                buf = self.targets[name]
                # broadcast works on a contiguous tensor: the target itself, or a copy of it
                flat = buf if buf.is_contiguous() else buf.contiguous()
                dist.broadcast(flat, src=ranks[stage], group=group)
                if stage != me and flat is not buf:
                    buf.copy_(flat)
        return {n for stage_names in names for n in stage_names}

    def sample(self, prompts: list[list[int]],
               req: Any) -> tuple[list[list[int]], list[list[float]]]:  # fmt: skip
        """Sample ``prompts`` (the same list on every rank of a replica): each rank of the
        replica's model-parallel group decodes its contiguous share with the whole model,
        then every rank has every row (tokens and their log-probs)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from anyspeed.inference.decode import sample
        from anyspeed.training.step import unwrap

        group = ps.get_model_parallel_group()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        bounds = [len(prompts) * i // n for i in range(n + 1)]
        lo, hi = bounds[r], bounds[r + 1]
        mine: tuple[list[list[int]], list[list[float]]] = ([], [])
        if hi > lo:
            seeds = req.row_seeds[lo:hi] if req.row_seeds else None
            with self.states.rollout(), torch.no_grad():
                mine = sample([unwrap(c) for c in self.chunks], prompts[lo:hi],
                              replace(req, row_seeds=seeds, lockstep=False),
                              logprobs=True)  # fmt: skip
        shares: list[Any] = [None] * n
        dist.all_gather_object(shares, mine, group=group)
        return ([t for s in shares for t in s[0]], [lp for s in shares for lp in s[1]])
