"""Process group and Megatron parallel state for a layout, with Megatron-LM's seeding.

Collectives time out after ``--distributed-timeout-minutes`` (:data:`DEFAULT_TIMEOUT_MINUTES`
rather than gloo's half hour); :mod:`anyspeed.distributed.stall` turns a timeout into one line
naming the rank that did not answer.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch

from anyspeed.layout import Layout

DEFAULT_TIMEOUT_MINUTES = 10.0  # Megatron-LM's default; gloo's own is 30 minutes
_timeout = {"minutes": DEFAULT_TIMEOUT_MINUTES}


def timeout_minutes() -> float:
    """The bound :func:`set_timeout` gave (for a second set of groups made later)."""
    return _timeout["minutes"]


def set_timeout(minutes: float) -> None:
    """Bound every collective of the groups :func:`init_distributed` starts from now on
    (``--distributed-timeout-minutes``; set by ``anyspeed pretrain`` before the trainer)."""
    _timeout["minutes"] = float(minutes)


def _first_only(pp_ranks: list[int], *_: object) -> list[int]:
    return [pp_ranks[0]]


def init_distributed(layout: Layout, seed: int) -> None:
    """Start the process group (the device's backend) and Megatron's parallel state, every
    group with the timeout :func:`set_timeout` gave.

    Every generator is seeded as Megatron-LM does (offset per pipeline stage; the device and
    tensor-parallel generators through Megatron), so with CPU initialisation the initial
    weights are reproducible and independent of the tensor-parallel size.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from anyspeed.device import detect

    info = detect()
    if not info.is_cpu:  # one accelerator per local rank, as torchrun lays them out
        getattr(torch, info.type).set_device(int(os.environ.get("LOCAL_RANK", "0")))
    minutes = _timeout["minutes"]
    if not dist.is_initialized():
        dist.init_process_group(backend=info.dist_backend, timeout=timedelta(minutes=minutes))
        from anyspeed.distributed.stall import register

        register()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        hierarchical_context_parallel_sizes=layout.hierarchical_cp_sizes(),
        distributed_timeout_minutes=minutes,  # a float works: Megatron builds a timedelta
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        # DualPipeV: the embedding and the output layer are both on pipeline rank 0
        get_embedding_ranks=_first_only if layout.dualpipev else None,
    )
    from anyspeed.distributed.dualpipev import channels

    if layout.dualpipev:
        channels.create(minutes, split=layout.dualpipev_dw_detach)
    else:
        channels.deactivate()
    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)
