"""The interface between the engine and the stages: what is learned (:class:`Task`), apart from
how (step, loop, hooks), and a row of the stage table (:class:`Stage`, :class:`StagePlan`).

A task supplies Megatron's forward step and loss (with named metrics), its data (which may see
the model: a policy's own samples), model transforms, and extra frozen models built at the
training layout (a reference policy). The engine knows no stage by name: it runs the task it is
given. docs/architecture.md says what a new stage touches.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the engine's types; they import this module's interface, not back
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer

LossFunc = Callable[[torch.Tensor], tuple]


class TaskStopped(Exception):
    """A task stops the run on every rank with one line (e.g. a reward function failed); what
    was saved before stays as it was."""


@dataclass(frozen=True)
class FrozenModel:
    """A frozen model a task asks for, built at the training layout: the weights of checkpoint
    ``load``, or with ``adapters_off`` the trained model itself with its LoRA adapters off
    (no second copy)."""

    load: str | None = None
    adapters_off: bool = False
    iteration: int | None = None  # of ``load``: None for the one its tracker names
    transforms: tuple[Any, ...] = ()  # model transforms of the copy (e.g. packed-RoPE)
    model: Any = None  # its own ModelConfig (a reward model of another size); None: the run's


class Task:
    """``forward_step`` follows Megatron's contract ``(data_iterator, model) -> (output,
    loss_func)``; ``loss_func(output)`` returns ``(loss, metrics)`` or, for a global token mean,
    ``(loss_sum, count, metrics)``. ``metrics`` maps ``loss_key`` and every name in
    ``metrics`` to a scalar (averaged over micro-batches and data-parallel replicas; CP shares
    summed) or a ``[sum, count]`` pair (one global ratio: exact at every layout). Each reaches
    the log line, TensorBoard and the metrics file under its own name."""

    name: str = "task"
    loss_key: str = "lm loss"
    metrics: tuple[str, ...] = ()

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        raise NotImplementedError

    def build(self, model: Any, config: Any, layout: Any) -> list[torch.nn.Module] | None:
        """This rank's (un-wrapped) model chunks when the task trains another model than
        the GPT of ``model`` (a vision-language model); None: the GPT builder."""
        return None

    def transforms(self) -> list[Any]:
        """Model transforms the task needs (applied in order, before DDP)."""
        return []

    def schedule_shape(self, seq_length: int, micro_batch_size: int) -> tuple[int, int]:
        """(sequence length, micro-batch size) of the tensors pipeline stages exchange."""
        return seq_length, micro_batch_size

    def frozen_models(self) -> dict[str, FrozenModel]:
        """Extra frozen models by name; the engine builds them into ``trainer.frozen``."""
        return {}

    def records(self) -> dict[str, Any]:
        """Extra entries every checkpoint of the run carries (e.g. the reference it used)."""
        return {}

    def load(self, run: Run, trainer: Trainer, scheduler: Any, state: LoopState) -> bool:
        """Load the task's starting point; False: the engine's resume from ``run.load``."""
        return False

    def setup(self, trainer: Trainer) -> None:
        """Called once the model, the optimizer, the frozen models and the load are in place."""

    def hooks(self, run: Run) -> list[Any]:
        """Loop hooks of the task's own (after the engine's; e.g. saving a second model)."""
        return []

    def datasets(self, run: Run) -> list[Any]:
        """(train, valid, test) data sources; None for an empty split."""
        raise NotImplementedError

    def batches(
        self,
        dataset: Any,
        run: Run,
        consumed: int,
        device: torch.device,
        trainer: Trainer | None = None,
    ) -> Iterator[list[dict[str, Any]]]:
        """This rank's micro-batches of each next global batch, from ``consumed`` samples on.
        ``trainer`` is the training model's owner: a task may generate from it here, between
        optimizer steps (:meth:`Trainer.generate`)."""
        raise NotImplementedError


@dataclass(frozen=True)
class StagePlan:
    """What a stage's checks produce from the frozen flags (before the generic checks):
    the ``.bin/.idx`` prefixes the generic checks validate (None: none, e.g. mock data), the
    stage's config and opened data, and records for every checkpoint of the run."""

    data_prefixes: list[str] | None = None
    config: Any = None
    data: Any = None
    records: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    """One row of the stage table (``command``: the CLI command that runs it)."""

    name: str
    command: str
    help: str
    flags: Sequence[Callable[[argparse.ArgumentParser], None]]
    plan: Callable[[argparse.Namespace], StagePlan]
    task: Callable[[Run], Task]
    argv: Callable[[list[str]], list[str]] | None = None  # rewrites the command line first
