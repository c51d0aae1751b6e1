"""Training tasks: what is learned (datasets, forward step, loss), apart from how (the step,
the loop). Pretraining now; SFT, DPO and GRPO add a module each."""

from anyspeed.training.tasks.base import Task
from anyspeed.training.tasks.pretrain import PretrainTask
from anyspeed.training.tasks.sft import SFTTask

__all__ = ["PretrainTask", "SFTTask", "Task"]
