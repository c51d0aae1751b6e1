"""The saved-activation bytes of the first step, reported by ``anyspeed pretrain``.

What autograd keeps for backward for one micro-batch on each rank (all its model chunks),
measured by :class:`anyspeed.features.memory.meter.FirstForwardMeter` during the first step:
the figure ``anyspeed memory`` estimates, and the one the memory features lower.
"""

from __future__ import annotations

from typing import Any

from anyspeed.distributed.process import print0
from anyspeed.training.loop import Hook, LoopState


class SavedBytesHook(Hook):
    """Meters the first step's first micro-batch; prints rank 0's and the largest rank's."""

    def __init__(self, prog: str = "anyspeed pretrain") -> None:
        self.meter: Any = None
        self.prog = prog
        self.started = False

    def on_start(self, state: LoopState) -> None:
        self.started = False

    def before_step(self, state: LoopState) -> None:
        # Armed just before the first step: forward-only passes a task runs while it makes
        # the step's data (a reference, a rollout) are not the step's activations.
        if self.started:
            return
        from anyspeed.features.memory.meter import FirstForwardMeter

        self.started = True
        self.meter = FirstForwardMeter(state.trainer.model)

    def after_step(self, state: LoopState, out: dict[str, Any]) -> None:
        if self.meter is None:
            return
        import torch
        import torch.distributed as dist

        from anyspeed.device import torch_device

        self.meter.remove()
        mine = self.meter.bytes
        self.meter = None
        most = torch.tensor([mine], dtype=torch.float64, device=torch_device())
        if dist.is_initialized():
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
        state.history["saved_bytes"] = mine
        print0(
            f"{self.prog}: activations saved for backward per micro-batch: "
            f"{mine / 2**20:.2f} MiB on rank 0, {float(most[0]) / 2**20:.2f} MiB on the "
            "largest rank"
        )
