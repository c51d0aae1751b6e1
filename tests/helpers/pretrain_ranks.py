"""Pretraining runs inside spawned ranks (importable by name for spawn)."""

from __future__ import annotations


def pretrain(cli: list[str], crash_on_save: int | None = None, nan_at: int | None = None) -> dict:
    """Run ``anyspeed pretrain`` with ``cli`` in this rank; return its history (no trainer).

    Faults come through the loop's FaultInjection hook: ``crash_on_save=N`` kills the process
    (``os._exit(17)``) after the N-th checkpoint's data is written but before it is renamed into
    place; ``nan_at=N`` turns one weight into NaN just before iteration N (a diverging run).
    """
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train
    from anyspeed.training.hooks import FaultInjection

    args, _ = prepare(cli)
    faults = FaultInjection(nan_at=nan_at, crash_on_save=crash_on_save)
    history = train(args, task_for(args), extra_hooks=[faults])
    trainer = history.pop("trainer")
    history["pending_gathers"] = pending_gathers(trainer)
    history["state_bytes"] = state_bytes(trainer)
    history["estimate"] = estimated_state(args)
    return history


def pending_gathers(trainer) -> int:  # noqa: ANN001 - anyspeed's Trainer
    """Megatron-FSDP parameter all-gathers still in flight when the run returned."""
    pipes = [
        getattr(getattr(c, "module", None), "all_gather_pipeline", None) for c in trainer.model
    ]
    return sum(len(getattr(p, "param_gather_event_map", {})) for p in pipes)


def estimated_state(run) -> dict[str, int]:  # noqa: ANN001 - a checked Run
    """What ``anyspeed memory`` says this rank holds of parameters, gradients and optimizer
    state (pipeline stage 0)."""
    import torch.distributed as dist

    from anyspeed.commands.memory import options
    from anyspeed.models.memory import estimate_stage

    world = dist.get_world_size()
    mem = estimate_stage(run.model, run.layout, world, options(run.args, run.layout.dp(world)), 0)
    return {"params": mem.parameters, "grads": mem.gradients, "optimizer": mem.optimizer}


def _local(t):  # noqa: ANN001, ANN202 - a tensor or a DTensor (an FSDP2 shard)
    return t.to_local() if hasattr(t, "to_local") else t


def _megatron_fsdp_bytes(chunk) -> tuple[int, int, int]:  # noqa: ANN001 - its wrapper
    """Megatron-FSDP's own buffers: (model weights, gradients, fp32 master weights)."""
    sums = [0, 0, 0]
    names = ("model_weight_buffer", "main_grad_buffer", "main_weight_buffer")
    for group in chunk.param_and_grad_buffer.parameter_groups:
        for i, name in enumerate(names):
            buf = getattr(group, name, None)
            if buf is not None and getattr(buf, "data", None) is not None:
                sums[i] += buf.data.numel() * buf.data.element_size()
    return sums[0], sums[1], sums[2]


def state_bytes(trainer) -> dict[str, int]:  # noqa: ANN001 - anyspeed's Trainer
    """Bytes this rank holds of the parameters, the gradients and the optimizer's state
    (its own tensors, measured: DDP's gradient buffers, FSDP2's local shards, Megatron-FSDP's
    buffers)."""
    params = grads = masters = 0
    if hasattr(trainer.model[0], "param_and_grad_buffer"):
        params, grads, masters = _megatron_fsdp_bytes(trainer.model[0])
        return {"params": params, "grads": grads, "optimizer": masters + _optimizer_bytes(trainer)}
    for chunk in trainer.model:
        for p in chunk.parameters():
            params += _local(p).numel() * _local(p).element_size()
            if getattr(p, "main_grad", None) is None and p.grad is not None:
                grads += _local(p.grad).numel() * _local(p.grad).element_size()
        ddp_buffers = getattr(chunk, "buffers", None)  # Megatron DDP: a list; FSDP2: a method
        for buf in ddp_buffers if isinstance(ddp_buffers, list) else []:
            grads += buf.grad_data.numel() * buf.grad_data.element_size()
    return {"params": params, "grads": grads, "optimizer": _optimizer_bytes(trainer)}


def _optimizer_bytes(trainer) -> int:  # noqa: ANN001 - anyspeed's Trainer
    opt = 0
    for inner in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for state in inner.optimizer.state.values():
            for v in state.values():
                if hasattr(v, "numel") and v.dim() > 0:
                    opt += _local(v).numel() * _local(v).element_size()
    return opt


def pretrain_many(clis: list[list[str]]) -> list[dict]:
    """:func:`pretrain` for each command line in turn, in one process group (same features)."""
    return [pretrain(cli) for cli in clis]
