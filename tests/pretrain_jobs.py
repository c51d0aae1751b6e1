"""Pretraining runs inside spawned ranks (importable by name for spawn)."""

from __future__ import annotations

import os


def pretrain(cli: list[str], crash_on_save: int | None = None, nan_at: int | None = None) -> dict:
    """Run ``anyspeed pretrain`` with ``cli`` in this rank; return its history (no trainer).

    ``crash_on_save=N`` kills the process (``os._exit``) after the N-th checkpoint's data is
    written but before it is renamed into place: a kill in the middle of a save.
    ``nan_at=N`` turns one weight into NaN just before iteration N (a diverging run).
    """
    from anyspeed.training.pretrain import prepare, train

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
    if nan_at is not None:
        import torch

        from anyspeed.training.engine import Trainer

        real_step = Trainer.step

        def poisoned_step(self, *a, **kw):
            if self.iteration + 1 == nan_at:
                with torch.no_grad():
                    next(self.model[0].parameters()).fill_(float("nan"))
            return real_step(self, *a, **kw)

        Trainer.step = poisoned_step
    args, _ = prepare(cli)
    history = train(args)
    history.pop("trainer")
    return history
