"""Pretraining runs inside spawned ranks (importable by name for spawn)."""

from __future__ import annotations

import os


def pretrain(cli: list[str], crash_on_save: int | None = None) -> dict:
    """Run ``anyspeed pretrain`` with ``cli`` in this rank; return its history (no trainer).

    ``crash_on_save=N`` kills the process (``os._exit``) after the N-th checkpoint's data is
    written but before it is renamed into place: a kill in the middle of a save.
    """
    from anyspeed.training.arguments import check_args, parse_pretrain_args
    from anyspeed.training.pretrain import train

    if crash_on_save is not None:
        from megatron.core import dist_checkpointing

        real_save, calls = dist_checkpointing.save, []

        def dying_save(*a, **kw):
            out = real_save(*a, **kw)
            calls.append(1)
            if len(calls) == crash_on_save:
                os._exit(17)
            return out

        dist_checkpointing.save = dying_save
    args = parse_pretrain_args(cli)
    check_args(args, int(os.environ["WORLD_SIZE"]))
    history = train(args)
    history.pop("trainer")
    return history
