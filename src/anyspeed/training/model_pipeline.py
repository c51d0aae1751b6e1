"""The model pipeline: build -> transforms -> precision -> DDP, then the optimizer.

Each stage is an explicit, ordered step (as torchtitan applies TP, then checkpointing, then
FSDP). ``transforms`` is where model changes that must happen before gradients are bucketed
plug in (LoRA adapters, freezing): each is a callable ``(chunk, model_config) -> chunk`` applied
to every pipeline chunk in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from anyspeed.layout import Layout
from anyspeed.models import gpt
from anyspeed.models.config import ModelConfig
from anyspeed.training.config import TrainConfig

Transform = Callable[[torch.nn.Module, ModelConfig], torch.nn.Module]
Builder = Callable[[ModelConfig, Any, Layout], "list[torch.nn.Module] | None"]


def build_chunks(
    model: ModelConfig,
    layout: Layout,
    cfg: TrainConfig,
    transforms: Sequence[Transform] = (),
    builder: Builder | None = None,
) -> tuple[list[torch.nn.Module], Any]:
    """This rank's model chunks after the transforms and the precision wrapper (no DDP yet),
    with their TransformerConfig; Megatron's parallel state must be initialised. ``builder``
    (a task's) builds other models than the GPT from the same config (None: the GPT)."""
    from anyspeed.device import torch_device

    config = gpt.transformer_config(
        model, layout, bf16=cfg.bf16, fp16=cfg.fp16, **cfg.config_fields()
    )
    chunks = (builder and builder(model, config, layout)) or gpt.build_chunks(model, config, layout)
    for transform in transforms:
        chunks = [transform(chunk, model) for chunk in chunks]
    chunks = [chunk.to(torch_device()) for chunk in chunks]
    if cfg.bf16 or cfg.fp16:
        from megatron.core.transformer.module import Float16Module

        wrapper = Float16Module
        if layout.dualpipev:  # casts at the V's ends, not by pipeline rank
            from anyspeed.distributed.dualpipev.precision import VFloat16Module as wrapper
        chunks = [wrapper(config, chunk) for chunk in chunks]
    return chunks, config


def wrap_ddp(
    chunks: list[torch.nn.Module], config: Any, layout: Layout, cfg: TrainConfig
) -> list[torch.nn.Module]:
    """Megatron's DDP around every chunk (gradient buckets on the first chunk only), or one of
    its FSDP wrappers (:mod:`anyspeed.training.sharding`)."""
    from anyspeed.training import sharding

    return sharding.wrap(chunks, config, layout, cfg.grad_reduce_in_fp32)


def build_model(
    model: ModelConfig,
    layout: Layout,
    cfg: TrainConfig,
    transforms: Sequence[Transform] = (),
    builder: Builder | None = None,
) -> list[torch.nn.Module]:
    """The whole pipeline: this rank's chunks, transformed, in ``cfg``'s precision, in DDP."""
    chunks, config = build_chunks(model, layout, cfg, transforms, builder)
    ddp = wrap_ddp(chunks, config, layout, cfg)
    _set_sync_funcs(ddp, layout)
    return ddp


def build_optimizer(model: list[torch.nn.Module], cfg: TrainConfig, layout: Layout):
    """Megatron's (optionally distributed) optimizer over the DDP chunks."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from anyspeed.training import muon

    opt_config = OptimizerConfig(
        optimizer="adam" if cfg.optimizer in muon.MUON else cfg.optimizer,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        loss_scale=cfg.loss_scale,
        initial_loss_scale=cfg.initial_loss_scale,
        min_loss_scale=cfg.min_loss_scale,
        loss_scale_window=cfg.loss_scale_window,
        hysteresis=cfg.hysteresis,
        params_dtype=gpt.params_dtype(cfg.bf16, cfg.fp16),
        use_distributed_optimizer=layout.distributed_optimizer,
        overlap_param_gather=layout.overlap_param_gather,
        **cfg.muon.fields(),
    )
    if cfg.optimizer in muon.MUON:
        return muon.build(opt_config, model, cfg.optimizer, cfg.muon)
    return get_megatron_optimizer(opt_config, model)


def _set_sync_funcs(model: list[torch.nn.Module], layout: Layout) -> None:
    """Hand the schedule the gradient/parameter sync hooks of the DDP chunks."""
    from megatron.core.distributed import finalize_model_grads

    def one_or_list(fns: list[Any]) -> Any:
        return fns[0] if len(fns) == 1 else fns

    config = model[0].config
    config.finalize_model_grads_func = finalize_model_grads
    if layout.overlap_grad_reduce:
        config.no_sync_func = one_or_list([m.no_sync for m in model])
        config.grad_sync_func = one_or_list([m.start_grad_sync for m in model])
    if layout.overlap_param_gather:
        config.param_sync_func = one_or_list([m.start_param_sync for m in model])


@contextlib.contextmanager
def sequence_parallel_off(model: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Sequence parallelism switched off (and back) in ``model``'s layers and config: decoding
    feeds one token per row, which cannot be split over the tensor-parallel ranks. The
    weights are the same either way; only where activations are gathered changes."""
    flags = ("sequence_parallel", "reduce_scatter_embeddings")
    on = [
        (m, f)
        for chunk in model
        for m in chunk.modules()
        for f in flags
        if getattr(m, f, None) is True
    ]
    configs = {
        id(c): c
        for chunk in model
        for m in chunk.modules()
        if (c := getattr(m, "config", None)) is not None and getattr(c, "sequence_parallel", False)
    }
    for m, f in on:
        setattr(m, f, False)
    for c in configs.values():
        c.sequence_parallel = False
    try:
        yield
    finally:
        for m, f in on:
            setattr(m, f, True)
        for c in configs.values():
            c.sequence_parallel = True


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model chunk inside DDP and precision wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


@contextlib.contextmanager
def eval_mode(model: Sequence[torch.nn.Module]) -> Iterator[None]:
    """``model`` in eval mode inside the block; the chunks that were training train again."""
    training = [m for m in model if m.training]
    for m in training:
        m.eval()
    try:
        yield
    finally:
        for m in training:
            m.train()
