"""How a LoRA run of any stage starts: base weights, then adapters, optimizer and position."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer


def lora_start(lora_cfg: Any, run: Run, trainer: Trainer, scheduler: Any, state: LoopState) -> bool:
    """A LoRA run's start: base weights from ``--load`` (weights only), then adapters,
    optimizer and position from ``--lora-load``; checkpoints written afterwards hold the
    adapters. False without LoRA (the engine's resume)."""
    if lora_cfg is None:
        return False
    from anyspeed.checkpoint.load import load_checkpoint
    from anyspeed.training.engine import resume
    from anyspeed.training.lora import set_view

    if run.load:
        set_view(trainer.model, "base")
        load_checkpoint(run.load, trainer.model, None, None, finetune=True, load_rng=False)
    set_view(trainer.model, "adapters")
    if lora_cfg.load:
        resume(run, trainer, scheduler, state, root=lora_cfg.load, flag="--lora-load")
    return True


def resumed_dir(lora_cfg: Any, run: Run) -> str | None:
    """The iteration directory a run resumes from (``--lora-load``'s under LoRA, else
    ``--load``'s without ``--finetune``), where a task keeps its own state; None: a new
    start."""
    from anyspeed.checkpoint.reads import tracked_dir

    root = lora_cfg.load if lora_cfg is not None else None
    if lora_cfg is None and run.load and not run.args.finetune:
        root = run.load
    return tracked_dir(root) if root else None
