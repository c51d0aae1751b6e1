"""Functions spawned ranks run for the precision-feature tests (importable by name)."""

from __future__ import annotations

import torch

from anyspeed.layout import Layout
from anyspeed.models import ModelConfig
from anyspeed.training import synthetic
from anyspeed.training.config import TrainConfig
from anyspeed.training.step import Trainer


def _masters(opt) -> list:
    """The optimizer's fp32 masters as its state dict gives them (the checkpoint's view)."""
    inner = getattr(opt, "chained_optimizers", [opt])
    out = []
    for o in inner:
        state = o.state_dict()
        groups = state.get("fp32_from_fp16_params")
        if groups is None:  # distributed optimizer: this rank's shards
            groups = o.shard_fp32_from_float16_groups
        out += [p.detach().clone() for g in groups for p in g]
    return out


def _held_bytes(opt) -> dict:
    """Bytes the masters' storages and the residuals hold right now."""
    inner = getattr(opt, "chained_optimizers", [opt])
    masters = residual = 0
    for o in inner:
        store = getattr(o, "reuse_fp32_param", None)
        _, mains = o._get_model_and_main_params_data_float16()
        masters += sum(m.untyped_storage().nbytes() for m in mains)
        if store is not None:
            residual += sum(r.nbytes + t.nbytes for r, t in filter(None, store.residuals))
    return {"masters": masters, "residual": residual}


def reuse_runs(cases: list[dict], steps: int) -> list[dict]:
    """bf16 training per case (``argv``, ``layout``) in one process group: losses, grad norms,
    model weights, the bytes held between steps, and the masters a checkpoint would save."""
    from anyspeed import adaptor
    from anyspeed.features.precision import reuse_fp32

    out = []
    for case in cases:
        adaptor.undo()
        adaptor.apply(argv=case["argv"])
        reuse_fp32.CHUNK_BYTES = case.get("chunk_bytes", 64 * 2**20)
        t = Trainer(ModelConfig(), Layout(**case["layout"]), TrainConfig(bf16=True, lr=3e-3))
        results = [synthetic.train_step(t) for _ in range(steps)]
        held = _held_bytes(t.optimizer)
        out.append(
            {
                "loss": [r["loss"] for r in results],
                "grad_norm": [r["grad_norm"] for r in results],
                "ok": [r["ok"] for r in results],
                "held": held,
                "weights": [p.detach().clone() for p in t.model[0].parameters()],
                "masters": _masters(t.optimizer),
                "params": sum(p.numel() for p in t.model[0].parameters()),
                "dtype": {str(p.dtype) for p in t.model[0].parameters()},
            }
        )
        if case.get("resume"):  # the checkpointed masters load back and training continues
            state = t.optimizer.state_dict()
            t.optimizer.load_state_dict(state)
            out[-1]["after_load"] = [synthetic.train_step(t)["loss"] for _ in range(2)]
    torch.distributed.barrier()
    return out
