"""Loading a checkpoint of any saved layout: training state (model, optimizer, scheduler, RNG,
data position; ranks agree on failures) or weights only for inference (:func:`load_weights`).
Saving and the on-disk layout: :mod:`.save`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from anyspeed.checkpoint import checks, fsdp_dtensor
from anyspeed.checkpoint.errors import (
    CheckpointFileError,
    CheckpointMismatch,
)
from anyspeed.checkpoint.files import (
    RELEASE,
    TRACKER,
    iteration_dir,
)
from anyspeed.checkpoint.optimizer_groups import needs_regroup, regroup
from anyspeed.checkpoint.reads import read_common, read_rng, tracked_dir, within
from anyspeed.checkpoint.rng import rank_key, set_rng_state
from anyspeed.checkpoint.state import (
    FAILURES,
    is_distributed,
    layout_signature,
    load_model_entries,
    model_state,
    set_aside,
    sharding_metadata,
    unwrapped,
)
from anyspeed.distributed.dtensors import optimizer_dtensors
from anyspeed.distributed.process import agree


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
            unwrapped(model),
            optimizer,
            scheduler,
            finetune,
            load_optim,
            load_rng,
            keep,
        ),
    )


def load_weights(
    root: str, chunks: list[torch.nn.Module], iteration: int | None = None
) -> dict[str, Any]:
    """The model weights of the checkpoint under ``root`` (``iteration``'s, else the one its
    tracker names) into bare ``chunks`` (this rank's model, any layout; no optimizer or RNG
    state): inference's load. Returns the common state; a failure is
    :class:`CheckpointMismatch` on every rank, as for :func:`load_checkpoint`."""
    return _agreed_load(
        root, lambda path: _load(root, path, chunks, None, None, True, False, False), iteration
    )


def _agreed_load(
    root: str, load: Callable[[str], dict[str, Any]], iteration: int | None = None
) -> dict[str, Any]:
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
    except FAILURES as exc:  # whatever a broken file raises: one line, on all ranks
        error = f"--load {root!r}: {checks.describe_failure(path, exc) if path else exc}"
    error = agree(error)
    if error is not None:
        raise CheckpointMismatch(error)
    return out


def _load(
    root: str,
    path: str,
    chunks: list[torch.nn.Module],
    optimizer: Any | None,
    scheduler: Any | None,
    finetune: bool,
    load_optim: bool,
    load_rng: bool,
    keep: tuple[str, ...] = (),
) -> dict[str, Any]:
    common = read_common(path)
    weights_only = finetune or os.path.basename(path) == RELEASE
    has_optim = common.get("has_optimizer")
    if has_optim is None:  # a checkpoint not written by anyspeed (e.g. Megatron-LM's)
        has_optim = "optimizer" in _sharded_keys(path)
    want_optim = optimizer is not None and load_optim and not weights_only and has_optim
    _check_optimizer_fits(root, common, optimizer, want_optim)
    if _fsdp_dtensor(root, path, chunks, keep):
        fsdp_dtensor.load(path, chunks, optimizer if want_optim else None, common)
    else:
        _load_torch_dist(root, path, chunks, optimizer, want_optim, common, keep)
    if optimizer is not None and not want_optim and hasattr(optimizer, "reload_model_params"):
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


def _load_torch_dist(
    root: str,
    path: str,
    chunks: list[torch.nn.Module],
    optimizer: Any | None,
    want_optim: bool,
    common: dict[str, Any],
    keep: tuple[str, ...],
) -> None:
    """Model (and optimizer) state from a torch_dist checkpoint, at any layout."""
    from megatron.core import dist_checkpointing

    state: dict[str, Any] = model_state(chunks)
    kept = set_aside(state, keep)
    if want_optim:
        sharding = common.get("optimizer_sharding", "fully_reshardable")
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=True, metadata=sharding_metadata(sharding)
        )
    loaded = dist_checkpointing.load(state, path)
    for entry, values in kept.items():
        loaded[entry].update(values)
    load_model_entries(chunks, loaded)
    if not want_optim:
        return
    opt_state = loaded["optimizer"]
    if needs_regroup(opt_state, optimizer):  # saved at another EP: expert optimizer or not
        if not is_distributed(optimizer):
            raise CheckpointMismatch(
                f"--load {root!r}: its optimizer state was saved at another "
                "--expert-model-parallel-size; resume at that size, with "
                "--use-distributed-optimizer, or pass --no-load-optim"
            )
        opt_state = regroup(opt_state, optimizer)
    with torch.no_grad():  # the state is copied into views of the parameters
        optimizer.load_state_dict(optimizer_dtensors(opt_state, optimizer))


def _fsdp_dtensor(root: str, path: str, chunks: list[torch.nn.Module], keep: tuple) -> bool:
    """Whether ``path`` is a Megatron-FSDP checkpoint this Megatron-FSDP run loads; one line
    when the run and the checkpoint do not go together (checked before start too)."""
    now = fsdp_dtensor.is_megatron_fsdp(chunks)
    mismatch = checks.fsdp_mismatch(path, now, layout_signature()["tp"], weights_only=False)
    if mismatch:
        raise CheckpointMismatch(f"--load {root!r}: {mismatch}")
    if now and keep:
        raise CheckpointMismatch(f"--load {root!r}: a new head on a Megatron-FSDP checkpoint")
    return now


def _check_optimizer_fits(
    root: str, common: dict[str, Any], optimizer: Any | None, want_optim: bool
) -> None:
    """The saved optimizer state loads into this run's optimizer at this layout."""
    saved_distopt = common.get("distributed_optimizer")
    if want_optim and saved_distopt is not None and saved_distopt != is_distributed(optimizer):
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


def _sharded_keys(path: str) -> set[str]:
    """Top-level names of what a checkpoint holds (``optimizer`` present or not)."""
    from megatron.core import dist_checkpointing

    keys = set()
    for key in dist_checkpointing.load_tensors_metadata(path):
        keys.add("optimizer" if key.startswith("optimizer.") else key.split(".", 1)[0])
    return keys
