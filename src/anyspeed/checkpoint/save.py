"""Saving: atomic, layout-independent checkpoints with Megatron's dist_checkpointing (torch_dist).

Layout on disk, as Megatron-LM writes it: ``<dir>/iter_0000100/`` (a dist_checkpointing
checkpoint) and ``<dir>/latest_checkpointed_iteration.txt``. A save goes to
``iter_0000100.tmp``; only when every rank has finished does rank 0 rename it and then replace
the ``latest`` file (write + rename), so a kill at any moment leaves the previous checkpoint
loadable and ``latest`` pointing at it. A save or load that fails on any rank (disk full,
permission, a broken file) fails on every rank with one line: the ranks agree on each step's
outcome, so none waits for a peer that gave up. Model and optimizer state are saved in Megatron's
global (fully reshardable) form, so a run resumes under another TP/PP/DP layout; the data
position is the number of consumed samples, which no layout change alters.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from anyspeed.checkpoint import checks, fsdp_dtensor
from anyspeed.checkpoint.errors import (
    CheckpointSaveError,
)
from anyspeed.checkpoint.files import (
    iteration_dir,
    read_tracker,
    remove_stale,
    write_tracker,
)
from anyspeed.checkpoint.rng import rank_key, rng_state
from anyspeed.checkpoint.state import (
    CHECKPOINT_VERSION,
    FAILURES,
    is_distributed,
    layout_signature,
    model_state,
    optimizer_sharding,
    sharding_metadata,
    unwrapped,
)
from anyspeed.distributed.process import agree


def last_good(root: str) -> str | None:
    """The checkpoint directory ``root``'s tracker names, when it is there (else None)."""
    try:
        it = read_tracker(root)
    except (ValueError, OSError):
        return None
    path = iteration_dir(root, it) if it is not None else None
    return path if path is not None and os.path.isdir(path) else None


def save_checkpoint(
    root: str,
    iteration: int,
    model: list[torch.nn.Module],
    optimizer: Any | None,
    scheduler: Any | None,
    extra: dict[str, Any],
    *,
    save_rng: bool = True,
    before_commit: Callable[[str], None] | None = None,
) -> str:
    """Save atomically to ``root/iter_XXXXXXX`` and point ``latest`` at it; returns the dir.

    ``save_rng=False`` (``--no-save-rng``) leaves the RNG states out; ``before_commit(tmp)``
    runs once the data is written, before the rename (tests kill the process there). A step
    that fails on any rank raises :class:`CheckpointSaveError` on all, naming the cause and the
    last good checkpoint, which stays as it was (the partial save is removed).
    """
    import torch.distributed as dist

    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    rank0 = dist.get_rank() == 0
    good = last_good(root)

    def step(fn: Callable[[], None]) -> None:
        error = None
        try:
            fn()
        except FAILURES as exc:  # every rank must learn of it
            error = checks.describe_save_failure(tmp if os.path.isdir(tmp) else root, exc)
        error = agree(error)
        if error is None:
            return
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(
            f"could not save checkpoint to {root}: {error}; last good "
            f"checkpoint: {good or 'none yet'}"
        )

    step(lambda: _prepare(root, tmp) if rank0 else None)
    step(lambda: _write(tmp, iteration, model, optimizer, scheduler, extra, save_rng))
    if before_commit is not None:
        before_commit(tmp)
    step(lambda: _commit(root, tmp, final, iteration) if rank0 else None)
    return final


def _prepare(root: str, tmp: str) -> None:
    os.makedirs(root, exist_ok=True)
    remove_stale(root)  # left over by runs killed mid-save
    os.makedirs(tmp)


def _write(
    tmp: str,
    iteration: int,
    model: list[torch.nn.Module],
    optimizer: Any | None,
    scheduler: Any | None,
    extra: dict[str, Any],
    save_rng: bool,
) -> None:
    common: dict[str, Any] = dict(
        iteration=iteration,
        checkpoint_version=CHECKPOINT_VERSION,
        anyspeed_layout=layout_signature(),
        has_optimizer=optimizer is not None,
        distributed_optimizer=optimizer is not None and is_distributed(optimizer),
        **extra,
    )
    if scheduler is not None:
        common["opt_param_scheduler"] = scheduler.state_dict()
    chunks = unwrapped(model)
    if fsdp_dtensor.is_megatron_fsdp(chunks):
        fsdp_dtensor.save(tmp, chunks, optimizer, common)
    else:
        _write_torch_dist(tmp, chunks, optimizer, common)
    if save_rng:
        rng_dir = os.path.join(tmp, "anyspeed_rng")
        os.makedirs(rng_dir, exist_ok=True)
        torch.save(rng_state(), os.path.join(rng_dir, f"{rank_key()}.pt"))


def _write_torch_dist(
    tmp: str, chunks: list[torch.nn.Module], optimizer: Any | None, common: dict[str, Any]
) -> None:
    from megatron.core import dist_checkpointing

    state: dict[str, Any] = model_state(chunks)
    state.update(common)
    if optimizer is not None:
        sharding = optimizer_sharding(optimizer)
        state["optimizer_sharding"] = sharding
        state["optimizer"] = optimizer.sharded_state_dict(
            state, metadata=sharding_metadata(sharding)
        )
    dist_checkpointing.save(state, tmp)


def _commit(root: str, tmp: str, final: str, iteration: int) -> None:
    """Rename ``tmp`` into place and point the tracker at it; saving an iteration again sets
    the old copy aside until the new one is in place (restored if the rename fails)."""
    old = final + ".old" if os.path.exists(final) else None
    if old:
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old:
            os.replace(old, final)
        raise
    write_tracker(root, iteration)
    if old:
        shutil.rmtree(old, ignore_errors=True)
