"""Full-vocabulary logits of token ids through the pipeline schedule, at any layout."""

from __future__ import annotations

import torch


@torch.no_grad()
def forward_logits(model: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits [b, s, vocab] of ``tokens`` through ``model``'s chunks (gathered across TP).

    Returned on the last pipeline stage; None on the other stages.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from anyspeed.device import torch_device

    dev = torch_device()
    tokens = tokens.to(dev)
    pos = torch.arange(tokens.shape[1], device=dev).expand(tokens.shape[0], -1)

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        out = chunk(tokens, pos, None)

        def collect(output_tensor, non_loss_data=True):
            return gather_from_tensor_model_parallel_region(output_tensor).clone()

        return out, collect

    for m in model:
        m.eval()
    n_chunks = len(model)
    data = [iter([0]) for _ in range(n_chunks)] if n_chunks > 1 else iter([0])
    try:
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=model if n_chunks > 1 else model[0],
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=True,
            collect_non_loss_data=True,
        )
    finally:
        for m in model:
            m.train()
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return out[0].cpu()
