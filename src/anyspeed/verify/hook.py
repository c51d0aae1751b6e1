"""The rank side of ``anyspeed verify``: a loop hook that starts the run from the reference's
initial weights, and at each optimizer step writes (reference) or compares (layout under
test) the gradients, then records loss and grad norm for the report."""

from __future__ import annotations

import json
import os
from typing import Any

from anyspeed.training.loop import Hook, LoopState

REFERENCE, LAYOUT = "reference", "layout"


class VerifyHook(Hook):
    """``role`` is :data:`REFERENCE` (writes ``workdir/init`` and its gradients) or
    :data:`LAYOUT` (loads ``workdir/init``, compares its gradients with the reference's)."""

    def __init__(self, role: str, workdir: str) -> None:
        self.role, self.workdir = role, workdir
        self.steps: list[dict[str, Any]] = []
        self.pending: dict[str, list[float]] = {}

    def on_start(self, state: LoopState) -> None:
        from anyspeed.checkpoint.load import load_checkpoint
        from anyspeed.checkpoint.save import save_checkpoint

        t = state.trainer
        init = os.path.join(self.workdir, "init")
        if self.role == REFERENCE:
            save_checkpoint(init, 0, t.model, None, None, {}, save_rng=False)
        else:  # the reference's weights, whatever this layout built or loaded
            load_checkpoint(
                init, t.model, t.optimizer, None, finetune=True, load_optim=False, load_rng=False
            )
        t.before_update.append(self.capture)

    def capture(self, trainer: Any) -> None:
        """Between the backward pass and the optimizer step: write or compare the gradients."""
        from anyspeed.verify import grads as G

        G.gather_sharded_grads(trainer.model)
        step = trainer.iteration + 1
        reference = os.path.join(self.workdir, REFERENCE, f"grads_{step}")
        if self.role == REFERENCE:
            G.save_grads(reference, trainer.model)
        else:
            self.pending = G.merge(G.gather_objects(G.compare_grads(reference, trainer.model)))

    def after_step(self, state: LoopState, out: dict[str, Any]) -> None:
        metrics = {
            k: v
            for k, v in out.get("metrics", {}).items()
            if not k.startswith("timing/") and not k.endswith("_tps")
        }
        self.steps.append(
            {
                "iteration": state.iteration,
                "loss": out["loss"],
                "grad_norm": out["grad_norm"],
                "ok": out["ok"],
                "metrics": metrics,
                "grads": self.pending,
            }
        )
        self.pending = {}

    def on_end(self, state: LoopState, completed: bool) -> None:
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return
        path = os.path.join(self.workdir, f"{self.role}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"steps": self.steps, "completed": completed}, f)
        os.replace(path + ".tmp", path)
