"""Extra frozen models a task asks for (a reference policy), built at the training layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from anyspeed.training.task import FrozenModel


@dataclass
class Frozen:
    """A frozen model's chunks; with ``adapters_off`` they are the training model's own,
    run with their LoRA adapters off inside :meth:`context`."""

    chunks: list[torch.nn.Module]
    adapters_off: bool = False

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        if not self.adapters_off:
            yield
            return
        from anyspeed.training.lora import adapters_off

        with adapters_off(self.chunks):
            yield


def build_frozen(trainer: Any, specs: dict[str, FrozenModel]) -> dict[str, Frozen]:
    """One :class:`Frozen` per spec: the training model with adapters off, or a new copy of
    the architecture at the training layout with a checkpoint's weights (no grad, eval)."""
    from anyspeed.checkpoint.load import load_weights
    from anyspeed.training.model_pipeline import build_chunks

    out = {}
    for name, spec in specs.items():
        if spec.adapters_off:
            out[name] = Frozen(trainer.model, adapters_off=True)
            continue
        model = spec.model or trainer.model_config
        build = None if spec.model else trainer.task.build  # another model is a GPT
        layout = trainer.layout  # noop slots are the trained model's: kept at its depth only
        if model.num_layers != trainer.model_config.num_layers:
            layout = layout.for_other_model()
        chunks, _ = build_chunks(model, layout, trainer.cfg, spec.transforms, build)
        for c in chunks:
            c.eval().requires_grad_(False)
        if spec.load:
            load_weights(spec.load, chunks, spec.iteration)
        out[name] = Frozen(chunks)
    return out
