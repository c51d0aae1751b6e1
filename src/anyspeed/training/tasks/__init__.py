"""Training tasks: what is learned (data, forward step, loss and metrics, frozen models),
apart from how (the step, the loop). One module per stage (+ its data module); the stage table
(:mod:`anyspeed.training.stages`) names them."""

from anyspeed.training.tasks.base import FrozenModel, Task
from anyspeed.training.tasks.pretrain import PretrainTask

__all__ = ["FrozenModel", "PretrainTask", "Task"]
