"""Per-step multi-token prediction losses, reported like the main loss.

Megatron-Core adds each MTP depth's loss to the gradients (scaled by
``--mtp-loss-scaling-factor``) and keeps the unscaled values in ``MTPLossLoggingHelper``'s
tracker, summed over micro-batches, on the ranks of the last pipeline stage. Here they become
``mtp_1 loss``, ... averaged over micro-batches and data-parallel replicas, as anyspeed reports
its main loss, so any layout reports the same figure.
"""

from __future__ import annotations

import torch

from anyspeed.distributed import pipeline


def mtp_losses(num_layers: int, num_microbatches: int, dp: int) -> dict[str, float]:
    """Each MTP depth's loss of the step just run (a collective: every rank calls it); the
    tracker is cleared for the next step."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from anyspeed.device import torch_device

    tracker = MTPLossLoggingHelper.tracker
    values = torch.zeros(num_layers, dtype=torch.float64, device=torch_device())
    # TP ranks hold the same value; the last stage's TP rank 0 of each replica contributes
    last = pipeline.is_output_stage() and ps.get_tensor_model_parallel_rank() == 0
    if "values" in tracker:
        if last:
            values += tracker["values"].detach().to(values.device, torch.float64)
        tracker["values"].zero_()
    torch.distributed.all_reduce(values)
    scale = 1.0 / (num_microbatches * dp)
    return {f"mtp_{i + 1} loss": float(v) * scale for i, v in enumerate(values.tolist())}
