"""The frozen reference model of DPO and GRPO (and PPO next): its flags, the checks of the
checkpoint, what the engine builds and what a checkpoint records so a resumed run keeps it."""

from __future__ import annotations

import argparse
import os
from typing import Any

from anyspeed.errors import UsageError
from anyspeed.training.task import FrozenModel


def add_reference_arguments(g: Any) -> None:
    """``--ref-model`` and ``--refer-model-iter`` (DPO, GRPO)."""
    g.add_argument(
        "--ref-model",
        default=None,
        help="the reference checkpoint (default: --load; under LoRA the base model)",
    )
    g.add_argument(
        "--refer-model-iter",
        type=int,
        default=None,
        help="the reference's iteration (default: the one its tracker names)",
    )


def reference(args: argparse.Namespace, lora_cfg: Any, stage: str) -> tuple[str | None, int | None]:
    """The reference checkpoint (root, iteration) of a ``stage`` run, checked; (None, None)
    under LoRA (the base with adapters off) or for the run's own ``--load`` resolved at start.

    Resuming a run of this stage (its ``--load`` such a checkpoint, no ``--finetune``) keeps
    the reference that run recorded, so a resumed run compares with the same model."""
    from anyspeed.checkpoint.errors import CheckpointFileError
    from anyspeed.checkpoint.reads import read_common, tracked_dir

    if lora_cfg is not None:
        if args.ref_model:
            raise UsageError(
                "--ref-model with LoRA: the reference is the --load base model "
                "with its adapters off; drop --ref-model"
            )
        return None, None
    ref, it = args.ref_model, args.refer_model_iter
    try:
        if ref is None and args.load and not args.finetune:
            path = tracked_dir(args.load)
            common = read_common(path) if path else {}
            recorded = common.get("anyspeed_reference")
            if common.get("anyspeed_stage") == stage and recorded:
                ref, it = recorded["path"], it if it is not None else recorded["iteration"]
        if ref is None:
            if not args.load:
                raise UsageError(
                    f"--stage {stage} needs a reference model: --load the model "
                    "to start from (an SFT checkpoint) or pass --ref-model"
                )
            return None, it
        _check_reference(args, ref, it)
    except CheckpointFileError as exc:
        raise UsageError(f"--ref-model {ref or args.load!r}: {exc}") from None
    return os.path.abspath(ref), it


def _check_reference(args: argparse.Namespace, ref: str, it: int | None) -> None:
    """The reference is a checkpoint of this architecture (one line otherwise)."""
    from anyspeed.checkpoint.checks import check_fits, verify
    from anyspeed.checkpoint.files import iteration_dir
    from anyspeed.checkpoint.reads import tracked_dir
    from anyspeed.models.presets import model_from_args

    if not os.path.isdir(ref) or tracked_dir(ref) is None:
        raise UsageError(
            f"--ref-model {ref!r} is not a checkpoint directory (no tracker file); "
            "give a directory anyspeed or Megatron-LM saved"
        )
    if it is not None and not os.path.isdir(iteration_dir(ref, it)):
        raise UsageError(f"--refer-model-iter {it}: {iteration_dir(ref, it)} does not exist")
    verify(iteration_dir(ref, it) if it is not None else tracked_dir(ref))  # as --load's files
    check_fits(ref, model_from_args(args))


def reference_model(
    lora_cfg: Any, ref: str | None, it: int | None, packed: Any = None
) -> dict[str, FrozenModel]:
    """The frozen reference a task asks for: the base with adapters off under LoRA (no second
    copy), else a copy with checkpoint ``ref``'s weights (``packed``: it reads packed
    sequences, its RoPE unfused)."""
    if lora_cfg is not None:
        return {"reference": FrozenModel(adapters_off=True)}
    return {"reference": FrozenModel(load=ref, iteration=it, transforms=packed_transforms(packed))}


def packed_transforms(packed: Any) -> tuple[Any, ...]:
    """The model transforms of a copy that reads packed (``thd``) sequences: RoPE restarting
    at each sequence (none when ``packed`` is falsy)."""
    from anyspeed.stages.common.instruction_data import unfused_rope

    return (unfused_rope,) if packed else ()


def reference_record(lora_cfg: Any, ref: str | None, it: int | None) -> dict[str, Any]:
    """The checkpoint record of a full reference, so that a resumed run keeps it."""
    if lora_cfg is not None or not ref:
        return {}
    return {"anyspeed_reference": {"path": os.path.abspath(ref), "iteration": it}}
