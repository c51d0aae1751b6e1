"""What the stages with a scalar head share (ORM's reward model, PPO's critic): whether a
checkpoint already holds the head (else a new one is put on its body)."""

from __future__ import annotations


def has_head(load: str) -> bool:
    """Whether the checkpoint under ``load`` holds a reward head."""
    from megatron.core import dist_checkpointing

    from anyspeed.checkpoint.reads import checkpoint_format, tracked_dir
    from anyspeed.models.reward_head import HEAD_KEY

    path = tracked_dir(load)
    if path is None or checkpoint_format(path) != "torch_dist":
        return False
    return any(k.endswith(HEAD_KEY) for k in dist_checkpointing.load_tensors_metadata(path))
