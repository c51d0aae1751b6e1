"""Functions spawned ranks run for the FP8 tests (importable by name)."""

from __future__ import annotations

import torch

from anyspeed.features.fp8.settings import Fp8Settings
from anyspeed.layout import Layout
from anyspeed.models import ModelConfig
from anyspeed.stages.pretrain.task import PretrainTask
from anyspeed.training import synthetic
from anyspeed.training.config import TrainConfig
from anyspeed.training.step import Trainer

FLAGS = {"format": "--fp8-format", "recipe": "--fp8-recipe"}


def argv_of(fp8: dict | None) -> list[str]:
    """The command line that asks for ``fp8`` (Fp8Settings fields) through the adaptor."""
    if fp8 is None:
        return []
    argv = ["--fp8-format", fp8.get("format", "hybrid"), "--fp8-recipe", fp8["recipe"]]
    if fp8.get("bf16_start"):
        argv += ["--first-last-layers-bf16"]
    return argv


def _saved_bytes(trainer: Trainer) -> int:
    """Bytes autograd saves over one forward of the first micro-batch."""
    from anyspeed.features.memory.meter import SavedBytes

    batch = synthetic.microbatches(trainer.model_config.vocab_size, trainer.cfg, 0)[0]
    chunk = trainer.model[0]
    with SavedBytes(exclude=list(chunk.parameters())) as meter:
        chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return meter.bytes


def runs(cases: list[dict], steps: int, init: str) -> dict[str, dict]:
    """Train each case (``name``, ``layout``, ``fp8`` settings, ``model``) for ``steps`` from
    the same weights (the first case saves them to ``init``, the others load them): its losses,
    grad norms, FP8 linears and the activation bytes of one forward."""
    from anyspeed import adaptor
    from anyspeed.features.fp8.linear import describe
    from helpers.trainer_ranks import load_weights, save_weights

    out = {}
    for case in cases:
        fp8 = case.get("fp8")
        adaptor.undo()
        adaptor.apply(argv=argv_of(fp8) + case.get("argv", []))
        cfg = TrainConfig(lr=3e-3, bf16=case.get("bf16", False), recompute=case.get("recompute",
                          {}), fp8=None if fp8 is None else Fp8Settings(**fp8))  # fmt: skip
        model = ModelConfig(**case.get("model", {}))
        t = Trainer(model, Layout(**case.get("layout", {})), cfg, PretrainTask())
        if case.get("init", True):  # the same weights as the first case's
            (load_weights if out else save_weights)(t, init)
        fp8_layers = sorted(
            {
                n.split(".layers.")[1].split(".")[0]
                for n, m in t.model[0].named_modules()
                if hasattr(m, "fp8_scales")
            }  # fmt: skip
        )
        saved = _saved_bytes(t) if case.get("meter") else None
        results = [synthetic.train_step(t) for _ in range(steps)]
        out[case["name"]] = {
            "loss": [r["loss"] for r in results],
            "grad_norm": [r["grad_norm"] for r in results],
            "fp8_linears": sum(hasattr(m, "fp8_scales") for m in t.model[0].modules()),
            "fp8_layers": fp8_layers,
            "saved": saved,
            "line": describe("anyspeed pretrain", t.model, cfg.fp8) if cfg.fp8 else None,
        }
    torch.distributed.barrier()
    return out
