"""Functions spawned ranks run for the memory features' tests (tests/memory)."""

from __future__ import annotations

from anyspeed.layout import Layout
from anyspeed.models import ModelConfig
from anyspeed.training.config import TrainConfig
from anyspeed.training.step import Trainer
from helpers import trainer_ranks


def metered_run(layout: dict, model: dict | None = None, steps: int = 5, load: str | None = None,
                save_init: str | None = None, **cfg) -> dict:  # fmt: skip
    """``steps`` steps at ``layout``; losses, grad norms and the bytes autograd saved for
    backward on this rank in the first step's first micro-batch (all model chunks)."""
    from anyspeed.features.memory.meter import FirstForwardMeter
    from anyspeed.training import synthetic

    t = Trainer(ModelConfig(**(model or {})), Layout(**layout), TrainConfig(**cfg))
    if save_init:
        trainer_ranks.save_weights(t, save_init)
    if load:
        trainer_ranks.load_weights(t, load)
    meter = FirstForwardMeter([m.module for m in t.model])
    out = [synthetic.train_step(t) for _ in range(steps)]
    return {"loss": [o["loss"] for o in out], "grad_norm": [o["grad_norm"] for o in out],
            "saved_bytes": meter.bytes}  # fmt: skip


def metered_cases(cases: list[dict]) -> list[dict]:
    """:func:`metered_run` per case (``argv`` for the adaptor, the rest its keywords) in one
    process group; the adaptor is re-applied with each case's flags."""
    from anyspeed import adaptor

    out = []
    for case in cases:
        case = dict(case)
        adaptor.undo()
        adaptor.apply(argv=case.pop("argv", []))
        out.append(metered_run(**case))
    adaptor.undo()
    return out
