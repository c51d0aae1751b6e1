"""``all_gather_into_tensor`` with a flat output under gloo.

NCCL accepts any output of ``world x input.numel()`` elements; gloo insists on the input's
shape with the first dimension multiplied (``ProcessGroupGloo::allgather: invalid tensor
size``). Megatron's ``gather_split_1d_tensor`` (the all-gather of ``--distribute-saved-
activations``) passes a flat output and a shaped input. The output is viewed as gloo wants: the
same memory, so the same bytes land where NCCL would put them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def flat_output_all_gather(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an ``all_gather_into_tensor``: on gloo, a contiguous output of the right size
    but another shape is viewed as ``[world * input.shape[0], *input.shape[1:]]``."""

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        if (
            input.dim() > 0
            and output.is_contiguous()
            and input.is_contiguous()
            and dist.get_backend(group) == "gloo"
        ):
            world = dist.get_world_size(group)
            want = (world * input.shape[0], *input.shape[1:])
            if output.numel() == world * input.numel() and tuple(output.shape) != want:
                output = output.view(want)
        return orig(output, input, group=group, async_op=async_op)

    all_gather_into_tensor.__doc__ = orig.__doc__
    return all_gather_into_tensor
