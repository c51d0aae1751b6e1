"""The RL rollout at another layout than training: the whole model (tensor- and
pipeline-parallel size 1) on every rank, each rank sampling its share of its replica's
sequences, so the rollout runs at TP 1 x DP (world size) whatever the training layout.

Before each rollout the weights move in memory from the training model: tensor-parallel shards
are all-gathered and joined by the resharding rules the checkpoint converter uses too
(:mod:`anyspeed.distributed.resharding`: fused parts included, LoRA adapters as their layer's
weight), expert-parallel ranks all-gather their experts and pipeline stages broadcast their
layers (both renumbered globally) to every rank.
The rollout model's tensors are then the gathered training model's, bit for bit. Megatron
reads its process groups from ``parallel_state`` when it runs, so the rollout model is built
and run inside a second, complete set of groups made for TP 1 / PP 1
(:class:`~anyspeed.distributed.parallel_state.ParallelState`, entered explicitly); the training
model keeps the groups it was built with.

MindSpeed-RL's names: ``--infer-tensor-parallel-size 1 --infer-pipeline-parallel-size 1
--infer-expert-parallel-size 1``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from anyspeed.checkpoint.rng import rng_state, set_rng_state
from anyspeed.distributed.groups import timeout_minutes
from anyspeed.distributed.parallel_state import ParallelState
from anyspeed.distributed.resharding import broadcast_stages, gather_whole, state_tensors
from anyspeed.layout import Layout
from anyspeed.training.model_pipeline import build_chunks, unwrap
from anyspeed.training.step import Trainer


@contextlib.contextmanager
def same_rng() -> Iterator[None]:
    """Every generator as it was (building a model draws initial weights): a run with a
    rollout layout consumes the same random numbers as one without."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)


class RolloutModel:
    """The whole model on every rank, synced from the trainer before each rollout."""

    def __init__(self, trainer: Trainer) -> None:
        self.state = ParallelState.build(timeout_minutes())  # TP 1, PP 1: DP = world size
        with same_rng(), self.state.entered():  # the task's transforms: LoRA's adapters
            chunks, _ = build_chunks(
                trainer.model_config,
                Layout(),
                trainer.cfg,
                trainer.task.transforms(),
                trainer.task.build,
            )
        self.chunks = [c.eval().requires_grad_(False) for c in chunks]
        self.targets = state_tensors(unwrap(self.chunks[0]))
        self.preset = trainer.model_config
        self.synced_at: int | None = None

    def sync(self, trainer: Trainer) -> float:
        """Move the trainer's weights in (once per optimizer step); seconds taken."""
        if self.synced_at == trainer.iteration:
            return 0.0
        t0 = time.perf_counter()
        shapes = {n: t.shape for n, t in self.targets.items()}
        with torch.no_grad():
            mine = gather_whole([unwrap(c) for c in trainer.model], shapes, self.preset)
            filled = broadcast_stages(mine, self.targets)
        left = [n for n in self.targets if n not in filled and not n.startswith("mtp.")]
        if left:
            raise RuntimeError(f"rollout model: no training tensor for {left[:3]}")
        self.synced_at = trainer.iteration
        return time.perf_counter() - t0

    def sample(
        self, prompts: list[list[int]], req: Any, kept: Any = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Sample ``prompts`` (the same list on every rank of a replica): each rank of the
        replica's model-parallel group decodes its contiguous share with the whole model,
        then every rank has every row (tokens and their log-probs). With ``kept`` a rank
        keeps its rows' KV cache, and a next turn's rows stay on the rank that has them."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from anyspeed.inference.decode import sample

        group = ps.get_model_parallel_group()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        mine = _my_rows(len(prompts), n, r, kept)
        got: tuple[list[list[int]], list[list[float]]] = ([], [])
        if mine:
            seeds = tuple(req.row_seeds[j] for j in mine) if req.row_seeds else None
            with self.state.entered(), torch.no_grad():
                got = sample(
                    [unwrap(c) for c in self.chunks],
                    [prompts[j] for j in mine],
                    replace(req, row_seeds=seeds, lockstep=False),
                    logprobs=True,
                    kept=kept,
                )
        if kept is not None:
            kept.owned = mine
        shares: list[Any] = [None] * n
        dist.all_gather_object(shares, (mine, got), group=group)
        tokens: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        for rows, (ts, ls) in shares:
            for j, t, lp in zip(rows, ts, ls, strict=True):
                tokens[j], lps[j] = t, lp
        return tokens, lps


def _my_rows(count: int, ranks: int, rank: int, kept: Any) -> list[int]:
    """The rows of a batch of ``count`` this rank decodes: its contiguous share, or, when
    ``kept.rows`` continues a batch, the rows it decoded last time (as ``kept.rows`` now
    orders them; ``kept.rows`` becomes their places in this rank's kept batch)."""
    if kept is None or kept.rows is None or kept.owned is None:
        if kept is not None:
            kept.rows = None  # a new batch: no cache to continue
        return list(range(count * rank // ranks, count * (rank + 1) // ranks))
    place = {row: at for at, row in enumerate(kept.owned)}
    mine = [j for j, row in enumerate(kept.rows) if row in place]
    kept.rows = [place[kept.rows[j]] for j in mine]
    if not mine:
        kept.stepper = None
    return mine
