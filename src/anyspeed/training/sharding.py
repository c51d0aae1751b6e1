"""The data-parallel wrapper of each model chunk: Megatron's DDP, or one of its two FSDP
wrappers: ``--use-torch-fsdp2`` (PyTorch's ``fully_shard`` per transformer layer, Megatron's
TorchFullyShardedDataParallel) and ``--use-megatron-fsdp`` (Megatron-FSDP with
``--data-parallel-sharding-strategy``: ``optim`` = ZeRO-1, ``optim_grads`` = ZeRO-2,
``optim_grads_params`` = ZeRO-3)."""

from __future__ import annotations

from typing import Any

import torch

from anyspeed.layout import Layout

# Megatron-FSDP's strategies that run; ``no_shard`` fails inside Megatron-FSDP 0.16.1 (its
# all-gather pipeline finds no weight buffer), see stages/checks.
SHARDING_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


def wrap(
    chunks: list[torch.nn.Module], config: Any, layout: Layout, grad_reduce_in_fp32: bool
) -> list[torch.nn.Module]:
    """Every chunk in the wrapper ``layout`` asks for (gradient buckets on the first chunk
    only)."""
    if layout.torch_fsdp2:
        return _torch_fsdp2(chunks, config, layout)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    wrapper: Any = DistributedDataParallel
    fsdp: dict[str, Any] = {}
    if layout.megatron_fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        wrapper = FullyShardedDataParallel
        fsdp = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": layout.fsdp_sharding}
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=layout.overlap_grad_reduce,
        overlap_param_gather=layout.overlap_param_gather,
        use_distributed_optimizer=layout.distributed_optimizer,
        bucket_size=layout.bucket_size,
        **fsdp,
    )
    return [
        wrapper(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def _torch_fsdp2(chunks: list[torch.nn.Module], config: Any, layout: Layout) -> list[Any]:
    from megatron.core.distributed import (
        TorchFullyShardedDataParallel,
        TorchFullyShardedDataParallelConfig,
    )
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    fsdp_config = TorchFullyShardedDataParallelConfig(
        reshard_after_forward=layout.fsdp2_reshard_after_forward
    )
    # Megatron's default set adds ColumnParallelLinear unless transformer_impl is "local"; on
    # the local spec it would wrap the layers' own linears a second time.
    units = {TransformerLayer, LanguageModelEmbedding, RotaryEmbedding}
    return [
        TorchFullyShardedDataParallel(
            config=config, ddp_config=fsdp_config, module=chunk, sub_modules_to_wrap=units
        )
        for chunk in chunks
    ]


def settle(chunks: list[torch.nn.Module]) -> None:
    """Wait for the parameter all-gathers Megatron-FSDP starts after each optimizer step (it
    prefetches the next forward's first buckets): a run then returns with no collective in
    flight into its buffers, before its groups are torn down or its weights read."""
    for chunk in chunks:
        pipeline = getattr(getattr(chunk, "module", None), "all_gather_pipeline", None)
        for bucket_id, bwd in list(getattr(pipeline, "param_gather_event_map", {})):
            pipeline.wait_bucket_ready(bucket_id, bwd)
