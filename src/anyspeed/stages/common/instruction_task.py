"""What every task on instruction-layout rows shares (SFT, the process reward model): the
per-token loss and packed-row transforms, LoRA's start, the split and the micro-batches.
A subclass supplies ``forward_step`` and says whether its labels are next-token targets."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.stages.common.instruction_data import unfused_rope
from anyspeed.stages.common.lora_start import lora_start
from anyspeed.stages.common.losses import per_token_loss
from anyspeed.training.task import Task

if TYPE_CHECKING:
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer


class InstructionTask(Task):
    """Padded samples or packed (``thd``) sequences of ``cfg.prefix``'s rows; ``cfg`` has
    ``packed``, ``pad_id`` and ``lora``. ``aligned``: labels stay at their own tokens (not
    shifted to next-token targets)."""

    aligned = False

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def transforms(self) -> list[Any]:
        packed = self.cfg.packed or getattr(self.cfg, "remove_padding", None) is not None
        own = [per_token_loss, unfused_rope] if packed else [per_token_loss]
        return own + ([self.cfg.lora.transform()] if self.cfg.lora else [])

    def schedule_shape(self, seq_length: int, micro_batch_size: int) -> tuple[int, int]:
        if self.cfg.packed:  # a packed micro-batch is one sequence of all its rows' tokens
            return seq_length * micro_batch_size, 1
        return seq_length, micro_batch_size

    def load(self, run: Run, trainer: Trainer, scheduler: Any, state: LoopState) -> bool:
        return lora_start(self.cfg.lora, run, trainer, scheduler, state)

    def datasets(self, run: Run) -> list[Any]:
        """(train, valid, test): the rows with each split's row range (or None)."""
        from anyspeed.stages.common.instruction_data import split_datasets

        return split_datasets(run.data, run.args.split)

    def batches(
        self,
        dataset: Any,
        run: Run,
        consumed: int,
        device: torch.device,
        trainer: Trainer | None = None,
    ) -> Iterator[list[dict[str, torch.Tensor]]]:
        from anyspeed.stages.common.instruction_data import batches

        data, rows = dataset
        packing = getattr(self.cfg, "remove_padding", None)
        return batches(
            data, run.args, rows, consumed, device, self.cfg.pad_id, self.aligned, packing
        )
