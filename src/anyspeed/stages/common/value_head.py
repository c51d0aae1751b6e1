"""What the stages with a scalar head share (ORM's reward model, PPO's critic): whether a
checkpoint already holds the head (else a new one is put on its body), the checks a model
directory such a stage reads gets before start, and where a sequence is scored."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from anyspeed.errors import UsageError


def check_model_dir(
    args: argparse.Namespace, path: str, flag: str, head: bool, model: Any = None
) -> str:
    """``path`` (named by ``flag`` in errors) checked before start as ``--load`` is: a
    checkpoint directory whose files are whole, of the run's architecture (or of ``model``);
    with ``head``, one holding a reward head. Its absolute path."""
    from anyspeed.checkpoint.checks import check_fits, verify
    from anyspeed.checkpoint.errors import CheckpointFileError
    from anyspeed.checkpoint.reads import tracked_dir
    from anyspeed.models.presets import model_from_args

    named = f"{flag} {path!r}"
    if not os.path.isdir(path) or tracked_dir(path) is None:
        raise UsageError(
            f"{named} is not a checkpoint directory (no tracker file); give the --save "
            "directory of an anyspeed or Megatron-LM run"
        )
    try:
        verify(tracked_dir(path))
        if head and not has_head(path):
            raise UsageError(
                f"{named} has no reward head: train one with --stage orm from a checkpoint "
                "of this model"
            )
        check_fits(path, model or model_from_args(args))
    except CheckpointFileError as exc:
        raise UsageError(f"{named}: {exc}") from None
    return os.path.abspath(path)


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """Each row's last token: one past its last labelled position (labels are shifted); the
    position a scalar head scores a sequence at."""
    pos = torch.arange(mask.shape[-1], device=mask.device)
    return ((mask > 0) * (pos + 1)).amax(-1).clamp(max=mask.shape[-1] - 1)


def has_head(load: str) -> bool:
    """Whether the checkpoint under ``load`` holds a reward head."""
    from megatron.core import dist_checkpointing

    from anyspeed.checkpoint.reads import checkpoint_format, tracked_dir
    from anyspeed.models.reward_head import HEAD_KEY

    path = tracked_dir(load)
    if path is None or checkpoint_format(path) != "torch_dist":
        return False
    return any(k.endswith(HEAD_KEY) for k in dist_checkpointing.load_tensors_metadata(path))
