"""The four one-way links DualPipeV's stages talk over, each its own copy of the pipeline group.

Between neighbouring ranks ``r`` and ``r + 1`` four kinds of message flow: chunk 0's
activations down, chunk 1's activations up, and the gradients of each coming back. Each kind
gets its own process group, so messages of one kind are matched in order (micro-batch order on
both sides) and never queue behind another kind's: on NCCL a pair's point-to-point operations
run in issue order on one stream, and one shared group would deadlock. The groups are made once
per pipeline group by every rank (:func:`create`) and found again by :func:`links`.
"""

from __future__ import annotations

from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch.distributed as dist


class Link(IntEnum):
    """A message kind; its value is also the message tag on backends that use tags."""

    DOWN = 1  # chunk 0's activations, rank r -> r + 1
    UP = 2  # chunk 1's activations, rank r + 1 -> r
    GRAD_DOWN = 3  # chunk 1's input gradients, rank r -> r + 1
    GRAD_UP = 4  # chunk 0's input gradients, rank r + 1 -> r


_LINKS: dict[tuple[int, ...], dict[Link, Any]] = {}
_ACTIVE: dict[str, Any] = {"pp_group": None, "split": False}


def create(timeout_minutes: float, split: bool = False) -> None:
    """Make the links of every pipeline group (every rank calls this, after Megatron's
    parallel state exists) and mark the pipeline of this parallel state as a V (``split``:
    weight gradients deferred where the pipeline would idle, ``--dualpipev-dw-detach``)."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    mine = tuple(dist.get_process_group_ranks(group))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    timeout = timedelta(minutes=timeout_minutes)
    for link in Link:
        for ranks in sorted(set(every)):
            made = dist.new_group(list(ranks), timeout=timeout)
            if ranks == mine:
                _LINKS.setdefault(mine, {})[link] = made
    _ACTIVE["pp_group"] = group
    _ACTIVE["split"] = split
    _connect(_LINKS[mine], mine)


def _connect(links: dict[Link, Any], ranks: tuple[int, ...]) -> None:
    """One element over every link of this pipeline, in an order without cycles (down the
    pipeline for links that go down, up for those that go up), so that a backend which sets a
    pair's connection up on first use (NCCL's two-rank communicators, whose set-up blocks both
    sides) does it here, not in the middle of a step's interleaved traffic."""
    import torch

    from anyspeed.device import torch_device

    me = ranks.index(dist.get_rank())
    one = torch.zeros(1, device=torch_device())
    for link, group in links.items():
        down = link in (Link.DOWN, Link.GRAD_DOWN)
        steps = (
            [(me - 1, "recv"), (me + 1, "send")] if down else [(me + 1, "recv"), (me - 1, "send")]
        )
        if not down:
            steps.reverse()  # first answer the rank below, then hear from the one above
        for peer, kind in steps:
            if 0 <= peer < len(ranks):
                op = dist.send if kind == "send" else dist.recv
                op(one, ranks[peer], group=group, tag=int(link))


def weight_split() -> bool:
    """Whether the V defers weight gradients (``--dualpipev-dw-detach``)."""
    return active() and bool(_ACTIVE["split"])


def active() -> bool:
    """Whether the pipeline of Megatron's current parallel state runs DualPipeV."""
    from megatron.core import parallel_state as ps

    if _ACTIVE["pp_group"] is None or not ps.model_parallel_is_initialized():
        return False
    return ps.get_pipeline_model_parallel_group() is _ACTIVE["pp_group"]


def deactivate() -> None:
    """Back to Megatron's schedules (a new parallel state without DualPipeV)."""
    _ACTIVE["pp_group"] = None


def links() -> dict[Link, Any]:
    """This rank's four links (RuntimeError when :func:`create` has not made them)."""
    from megatron.core import parallel_state as ps

    ranks = tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
    if ranks not in _LINKS:
        raise RuntimeError("DualPipeV's links were not created for this pipeline group")
    return _LINKS[ranks]
