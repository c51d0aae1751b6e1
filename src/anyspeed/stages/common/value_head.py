"""What the stages with a scalar head share (ORM's reward model, PPO's critic): whether a
checkpoint already holds the head (else a new one is put on its body), and where a sequence is
scored."""

from __future__ import annotations

import torch


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
