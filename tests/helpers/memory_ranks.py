"""Functions spawned ranks run for the memory features' tests (tests/memory)."""

from __future__ import annotations

import contextlib

import torch

from anyspeed.layout import Layout
from anyspeed.models import ModelConfig
from anyspeed.stages.pretrain.task import PretrainTask
from anyspeed.training.config import TrainConfig
from anyspeed.training.step import Trainer
from helpers import trainer_ranks


def metered_run(layout: dict, model: dict | None = None, steps: int = 5, load: str | None = None,
                save_init: str | None = None, trace: bool = False, offload: bool = False,
                **cfg) -> dict:  # fmt: skip
    """``steps`` steps at ``layout``; losses, grad norms and the bytes autograd saved for
    backward on this rank in the first step's first micro-batch (all model chunks); with
    ``trace``, the allocator's live bytes after the second step and its peak during it; with
    ``offload``, the optimizer offload's copies run with "device" and "host" both the CPU."""
    from anyspeed.device import torch_device
    from anyspeed.features.memory.meter import FirstForwardMeter
    from anyspeed.features.memory.offload import OptimizerOffload
    from anyspeed.features.memory.trace import AllocationTrace
    from anyspeed.training import synthetic

    tracer = AllocationTrace(torch_device().type) if trace else contextlib.nullcontext()
    with tracer:  # from before the model exists: every tensor of the run
        t = Trainer(
            ModelConfig(**(model or {})), Layout(**layout), TrainConfig(**cfg), PretrainTask()
        )
        if save_init:
            trainer_ranks.save_weights(t, save_init)
        if load:
            trainer_ranks.load_weights(t, load)
        meter = FirstForwardMeter([m.module for m in t.model])
        moved = OptimizerOffload(t.optimizer, torch_device(), "cpu") if offload else None
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        out = [synthetic.train_step(t)]
        if trace:
            AllocationTrace.mark("step1")
            out.append(synthetic.train_step(t))
            AllocationTrace.mark("step2")
    out += [synthetic.train_step(t) for _ in range(steps - len(out))]
    peak = torch.cuda.max_memory_allocated() if cuda else None
    measured = {"offload_copies": moved.copies if moved else 0, "device_peak": peak}
    if trace:  # the second step: the optimizer states exist before it
        measured |= {"live_after_step": tracer.held_at("step2"),
                    "step_peak": tracer.peak("step1", "step2")}  # fmt: skip
    out = out[:steps]
    return {"loss": [o["loss"] for o in out], "grad_norm": [o["grad_norm"] for o in out],
            "saved_bytes": meter.bytes, **measured, **held_bytes(t)}  # fmt: skip


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


def held_bytes(t: Trainer) -> dict:
    """Bytes the trainer's tensors hold on this rank, counted from the tensors themselves:
    parameters, the DDP gradient buffers (and the optimizer's fp32 copies of 16-bit ones), and
    the optimizer's states and main-parameter copies (a view of a model parameter counts
    nothing)."""
    params = [p for chunk in t.model for p in chunk.parameters()]
    model_storages = {p.untyped_storage().data_ptr() for p in params}
    buffers = [b for chunk in t.model for b in chunk.buffers + chunk.expert_parallel_buffers]
    grad_storages = {b.grad_data.untyped_storage().data_ptr() for b in buffers}
    seen: dict[int, int] = {}
    main_grads: dict[int, int] = {}  # fp32 copies of 16-bit buffer gradients
    for opt in getattr(t.optimizer, "chained_optimizers", [t.optimizer]):
        inner = opt.optimizer
        tensors = [v for state in inner.state.values() for v in state.values()]
        mains = [p for g in inner.param_groups for p in g["params"]]
        for x in tensors + mains:
            if hasattr(x, "untyped_storage"):
                st = x.untyped_storage()
                if st.data_ptr() not in model_storages:
                    seen[st.data_ptr()] = st.nbytes()
        for p in mains:
            if p.grad is not None and p.grad.untyped_storage().data_ptr() not in grad_storages:
                main_grads[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()
    from megatron.core import parallel_state as ps

    return {
        "stage": ps.get_pipeline_model_parallel_rank(),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
        + sum(main_grads.values()),
        "optimizer_bytes": sum(seen.values()),
    }
