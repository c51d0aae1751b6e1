"""Atomic, layout-independent checkpoints with Megatron's dist_checkpointing (torch_dist).

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
from torch.distributed.checkpoint.api import CheckpointException

from anyspeed.checkpoint import checks
from anyspeed.checkpoint.errors import (
    CheckpointFileError,
    CheckpointMismatch,
    CheckpointSaveError,
)
from anyspeed.checkpoint.files import (
    RELEASE,
    TRACKER,
    iteration_dir,
    read_tracker,
    remove_stale,
    write_tracker,
)
from anyspeed.checkpoint.optimizer_groups import needs_regroup, regroup
from anyspeed.checkpoint.reads import read_common, read_rng, tracked_dir, within
from anyspeed.checkpoint.rng import rank_key, rng_state, set_rng_state
from anyspeed.distributed.process import agree

CHECKPOINT_VERSION = 3.0


def optimizer_sharding(optimizer: Any) -> str:
    """How the distributed optimizer's state is laid out in the checkpoint.

    ``fully_reshardable`` (model space: loads under any TP/PP/DP) needs one gradient bucket per
    buffer: megatron-core 0.16.1 misplaces state across the padding between several buckets.
    With several buckets, ``dp_reshardable`` (Megatron-LM's default; reshards over DP only).
    """
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for buffer in getattr(o, "buffers", []):
            if len(buffer.buckets) > 1:
                return "dp_reshardable"
    return "fully_reshardable"


def _metadata(sharding: str = "fully_reshardable") -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "distrib_optim_sharding_type": sharding,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def _unwrapped(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The chunks inside training's DDP wrappers (what holds the sharded state dict)."""
    return [m.module for m in model]


def model_state(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """Megatron-LM's model entries of bare chunks: ``model`` (``model0``, ``model1`` for
    virtual stages)."""
    meta = {"dp_cp_group": _metadata()["dp_cp_group"]}
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=meta)}
    return {f"model{i}": c.sharded_state_dict(metadata=meta) for i, c in enumerate(chunks)}


def _load_model_entries(chunks: list[torch.nn.Module], state: dict[str, Any]) -> None:
    if len(chunks) == 1:
        chunks[0].load_state_dict(state["model"])
    else:
        for i, c in enumerate(chunks):
            c.load_state_dict(state[f"model{i}"])


def _set_aside(state: dict[str, Any], keep: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Take the model entries whose key starts with a prefix in ``keep`` out of ``state``;
    their current values by entry, to load back unchanged."""
    kept: dict[str, dict[str, Any]] = {}
    if not keep:
        return kept
    for entry, sd in state.items():
        for key in [k for k in sd if k.startswith(keep)]:
            kept.setdefault(entry, {})[key] = sd.pop(key).data.detach().clone()
    return kept


def layout_signature() -> dict[str, int]:
    """The parallel sizes of this run (RNG state is per rank, so it only loads under these)."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


# What a failed save or load raises: torch.distributed.checkpoint gathers its ranks' errors into
# a CheckpointException, which derives from BaseException.
_FAILURES = (Exception, CheckpointException)



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
        except _FAILURES as exc:  # every rank must learn of it
            error = checks.describe_save_failure(tmp if os.path.isdir(tmp) else root, exc)
        error = agree(error)
        if error is None:
            return
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(f"could not save checkpoint to {root}: {error}; last good "
                                  f"checkpoint: {good or 'none yet'}")  # fmt: skip

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


def _write(tmp: str, iteration: int, model: list[torch.nn.Module], optimizer: Any | None,
           scheduler: Any | None, extra: dict[str, Any], save_rng: bool) -> None:  # fmt: skip
    from megatron.core import dist_checkpointing

    state: dict[str, Any] = model_state(_unwrapped(model))
    state.update(
        iteration=iteration,
        checkpoint_version=CHECKPOINT_VERSION,
        anyspeed_layout=layout_signature(),
        has_optimizer=optimizer is not None,
        distributed_optimizer=optimizer is not None and _is_distributed(optimizer),
        **extra,
    )
    if optimizer is not None:
        sharding = optimizer_sharding(optimizer)
        state["optimizer_sharding"] = sharding
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=_metadata(sharding))
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(state, tmp)
    if save_rng:
        rng_dir = os.path.join(tmp, "anyspeed_rng")
        os.makedirs(rng_dir, exist_ok=True)
        torch.save(rng_state(), os.path.join(rng_dir, f"{rank_key()}.pt"))


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


def load_checkpoint(
    root: str,
    model: list[torch.nn.Module],
    optimizer: Any | None,
    scheduler: Any | None,
    *,
    finetune: bool = False,
    load_optim: bool = True,
    load_rng: bool = True,
    keep: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Load the checkpoint ``latest`` names into model (and optimizer, scheduler, RNG).

    Returns the checkpoint's common state (iteration, consumed samples, ...) with
    ``iteration`` 0 for ``finetune`` or a ``release`` checkpoint (weights only). Whatever
    fails on any rank raises :class:`CheckpointMismatch` on every rank, one line naming the
    file and the cause. Model entries starting with a prefix in ``keep`` are not read: they
    keep their values (a new head on a loaded body).
    """
    return _agreed_load(
        root,
        lambda path: _load(
            root,
            path,
            _unwrapped(model),
            optimizer,
            scheduler,
            finetune,
            load_optim,
            load_rng,
            keep,
        ),  # fmt: skip
    )


def load_weights(root: str, chunks: list[torch.nn.Module],
                 iteration: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The model weights of the checkpoint under ``root`` (``iteration``'s, else the one its
    tracker names) into bare ``chunks`` (this rank's model, any layout; no optimizer or RNG
    state): inference's load. Returns the common state; a failure is
    :class:`CheckpointMismatch` on every rank, as for :func:`load_checkpoint`."""
    return _agreed_load(root, lambda path: _load(root, path, chunks, None, None, True, False,
                                                 False), iteration)  # fmt: skip


def _agreed_load(root: str, load: Callable[[str], dict[str, Any]],
                 iteration: int | None = None) -> dict[str, Any]:  # fmt: skip
    """``load(iteration dir)`` on every rank; any rank's failure is one line on all."""
    error, out, path = None, {}, None
    try:
        path = tracked_dir(root) if iteration is None else iteration_dir(root, iteration)
        if iteration is not None and not os.path.isdir(path):
            raise CheckpointMismatch(f"{root!r} has no iteration {iteration} ({path})")
        if path is None:
            raise CheckpointMismatch(f"--load {root!r}: no {TRACKER} (not a checkpoint directory)")
        out = load(path)
    except CheckpointMismatch as exc:
        error = str(exc)
    except CheckpointFileError as exc:
        error = f"--load {root!r}: {exc}"
    except _FAILURES as exc:  # whatever a broken file raises: one line, on all ranks
        error = f"--load {root!r}: {checks.describe_failure(path, exc) if path else exc}"
    error = agree(error)
    if error is not None:
        raise CheckpointMismatch(error)
    return out


def _load(root: str, path: str, chunks: list[torch.nn.Module], optimizer: Any | None,
          scheduler: Any | None, finetune: bool, load_optim: bool, load_rng: bool,
          keep: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    from megatron.core import dist_checkpointing

    common = read_common(path)
    weights_only = finetune or os.path.basename(path) == RELEASE
    state: dict[str, Any] = model_state(chunks)
    kept = _set_aside(state, keep)
    has_optim = common.get("has_optimizer")
    if has_optim is None:  # a checkpoint not written by anyspeed (e.g. Megatron-LM's)
        has_optim = "optimizer" in _sharded_keys(path)
    want_optim = optimizer is not None and load_optim and not weights_only and has_optim
    _check_optimizer_fits(root, common, optimizer, want_optim)
    sharding = common.get("optimizer_sharding", "fully_reshardable")
    if want_optim:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=True, metadata=_metadata(sharding)
        )
    loaded = dist_checkpointing.load(state, path)
    for entry, values in kept.items():
        loaded[entry].update(values)
    _load_model_entries(chunks, loaded)
    if want_optim:
        opt_state = loaded["optimizer"]
        if needs_regroup(opt_state, optimizer):  # saved at another EP: expert optimizer or not
            if not _is_distributed(optimizer):
                raise CheckpointMismatch(
                    f"--load {root!r}: its optimizer state was saved at another "
                    "--expert-model-parallel-size; resume at that size, with "
                    "--use-distributed-optimizer, or pass --no-load-optim"
                )
            opt_state = regroup(opt_state, optimizer)
        with torch.no_grad():  # the state is copied into views of the parameters
            optimizer.load_state_dict(opt_state)
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # fp32 master copies follow the loaded weights
    if scheduler is not None and not weights_only and load_optim:
        if "opt_param_scheduler" in common:
            scheduler.load_state_dict(common["opt_param_scheduler"])
    if load_rng and not weights_only:
        same = common.get("anyspeed_layout") == layout_signature()
        rng_file = within(path, os.path.join("anyspeed_rng", f"{rank_key()}.pt"))
        if same and os.path.isfile(rng_file):
            try:
                set_rng_state(read_rng(rng_file))
            except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as exc:
                msg = f"{rng_file}: not a usable RNG state ({exc})"
                raise CheckpointFileError(msg) from None
    out = dict(common)
    if weights_only:
        out["iteration"] = 0
        out["consumed_train_samples"] = 0
    return out


def _check_optimizer_fits(root: str, common: dict[str, Any], optimizer: Any | None,
                          want_optim: bool) -> None:  # fmt: skip
    """The saved optimizer state loads into this run's optimizer at this layout."""
    saved_distopt = common.get("distributed_optimizer")
    if want_optim and saved_distopt is not None and saved_distopt != _is_distributed(optimizer):
        raise CheckpointMismatch(
            f"--load {root!r}: the checkpoint's optimizer state was saved "
            f"{'with' if saved_distopt else 'without'} --use-distributed-optimizer; resume "
            "with the same setting, or pass --no-load-optim to start the optimizer afresh"
        )
    sharding = common.get("optimizer_sharding", "fully_reshardable")
    if want_optim and sharding == "dp_reshardable":
        saved = common.get("anyspeed_layout", {})
        now = layout_signature()
        if any(saved.get(k) != now[k] for k in ("tp", "pp", "cp")):
            raise CheckpointMismatch(
                f"--load {root!r}: its distributed-optimizer state was saved with several "
                "gradient buckets and reloads only at the same TP/PP/CP sizes "
                f"({saved}); resume at that layout, or pass --no-load-optim"
            )


def _is_distributed(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in parts)


def _sharded_keys(path: str) -> set[str]:
    """Top-level names of what a checkpoint holds (``optimizer`` present or not)."""
    from megatron.core import dist_checkpointing

    keys = set()
    for key in dist_checkpointing.load_tensors_metadata(path):
        keys.add("optimizer" if key.startswith("optimizer.") else key.split(".", 1)[0])
    return keys
