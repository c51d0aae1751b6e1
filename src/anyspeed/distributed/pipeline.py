"""Where a pipeline's output is and which schedule runs it, for Megatron's schedules and V.

Megatron's own schedules keep the loss (and logits) on the last pipeline rank. Under DualPipeV
(:mod:`anyspeed.distributed.dualpipev`) the model folds back in a V and its output is on
pipeline rank 0. Code that reads a pipeline's output asks here instead of Megatron's
``is_pipeline_last_stage``.
"""

from __future__ import annotations

from typing import Any

from anyspeed.distributed.dualpipev import channels


def forward_backward_func() -> Any:
    """The schedule for Megatron's current parallel state (same call for all of them)."""
    if channels.active():
        from anyspeed.distributed.dualpipev.schedule import forward_backward_dualpipev

        return forward_backward_dualpipev
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()


def is_output_stage() -> bool:
    """Whether this rank's pipeline stage holds the model's output (loss, logits)."""
    from megatron.core import parallel_state as ps

    if channels.active():
        return ps.get_pipeline_model_parallel_rank() == 0
    return ps.is_pipeline_last_stage(ignore_virtual=True)


def output_rank() -> int:
    """The global rank of this pipeline group's output stage (a broadcast's source)."""
    from megatron.core import parallel_state as ps

    if channels.active():
        return ps.get_pipeline_model_parallel_first_rank()
    return ps.get_pipeline_model_parallel_last_rank()
