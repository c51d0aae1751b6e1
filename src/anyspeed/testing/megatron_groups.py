"""Megatron's ``destroy_model_parallel`` forgets its process groups; under gloo they stay alive.

Used by :mod:`anyspeed.testing.megatron` only: a model built before a teardown keeps using the
groups it captured (Megatron 0.16 modules hold them), which anyspeed's own runs rely on when
they build a second trainer in one process, so the one line itself leaves them alive.

Each gloo group holds its connections and threads (a run loop and a TCP loop per group, busy
while the peers live). Code that sets up parallel state again and again in one process —
Megatron's unit tests, a notebook, several layouts in one test — piled them up: 1,800 threads
per rank after Megatron's ``test_schedules.py`` (load average 1,900 on 2 cores, 280 s for a test
that takes seconds). Destroying the groups Megatron drops, when it drops them, keeps one set
(and the two ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP*`` it leaves set are reset too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist


def _groups(values: Any) -> Iterator[Any]:
    """Every process group in ``values`` (a group, or lists / tuples / dicts of them)."""
    if isinstance(values, dist.ProcessGroup):
        yield values
    elif isinstance(values, (list, tuple)):
        for v in values:
            yield from _groups(v)
    elif isinstance(values, dict):
        for v in values.values():
            yield from _groups(v)


def install() -> None:
    """Make ``parallel_state.destroy_model_parallel`` destroy the groups it forgets."""
    import megatron.core.parallel_state as ps

    if not getattr(ps.destroy_model_parallel, "_anyspeed_destroys_groups", False):
        ps.destroy_model_parallel = destroying_groups(ps.destroy_model_parallel)
        ps.destroy_model_parallel._anyspeed_destroys_groups = True  # type: ignore[attr-defined]


def destroying_groups(destroy: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``parallel_state.destroy_model_parallel``: the groups it forgets are destroyed."""

    @functools.wraps(destroy)
    def destroy_model_parallel(*args: Any, **kwargs: Any) -> Any:
        import megatron.core.parallel_state as ps

        held = {
            id(g): g for name, v in vars(ps).items() if name.startswith("_") for g in _groups(v)
        }
        out = destroy(*args, **kwargs)
        for name, v in list(vars(ps).items()):  # Megatron 0.16.1 forgets to reset these two
            if name.startswith("_INTRA_PARTIAL_DATA_PARALLEL_GROUP") and v is not None:
                setattr(ps, name, None)
        if not dist.is_initialized():
            return out
        world = dist.GroupMember.WORLD
        for group in held.values():
            if group is not world and group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)
        return out

    return destroy_model_parallel
