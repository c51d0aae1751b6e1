"""A complete set of Megatron's process groups as an object, entered explicitly.

Megatron-Core reads its groups from module globals of ``megatron.core.parallel_state`` when it
runs, so a second model at another layout (a rollout at TP 1, a critic) needs its own complete
set of them while it runs. :class:`ParallelState` holds one set: :meth:`ParallelState.build`
makes a new one (every rank takes part) without disturbing the one in use, and
:meth:`ParallelState.entered` puts it in place for a block and restores what was there. The
globals are named in :data:`STATE_GLOBALS` (Megatron-Core 0.16.1's); a name missing from the
installed Megatron is an error, and a test fails when Megatron adds one that is not listed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# Every module global of megatron.core.parallel_state that belongs to one set of groups: the
# groups, the ranks and sizes Megatron caches for them, and its per-state buffers.
STATE_GLOBALS = (
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "_PIPELINE_MODEL_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_EMBEDDING_GROUP",
    "_POSITION_EMBEDDING_GROUP",
    "_DATA_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP_GLOO",
    "_TENSOR_AND_DATA_PARALLEL_GROUP",
    "_EXPERT_MODEL_PARALLEL_GROUP",
    "_EXPERT_TENSOR_PARALLEL_GROUP",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
    "_EXPERT_DATA_PARALLEL_GROUP",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_EXPERT_MODEL_PARALLEL_RANK",
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE",
    "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_DATA_PARALLEL_WORLD_SIZE",
    "_MPU_DATA_PARALLEL_RANK",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK",
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
    "_EMBEDDING_GLOBAL_RANKS",
    "_POSITION_EMBEDDING_GLOBAL_RANKS",
    "_PIPELINE_GLOBAL_RANKS",
    "_DATA_PARALLEL_GLOBAL_RANKS",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
    "_EXPERT_MODEL_PARALLEL_RANKS",
    "_MODEL_PARALLEL_GLOBAL_RANKS",
    "_CONTEXT_PARALLEL_GROUP",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS",
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
    "_HYBRID_DP_CP_GROUPS",
    "_DATA_PARALLEL_GROUP_WITH_CP",
    "_DATA_PARALLEL_GROUP_WITH_CP_AG",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
    "_GLOBAL_MEMORY_BUFFER",
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER",
)


def _module() -> Any:
    from megatron.core import parallel_state as ps

    missing = [k for k in STATE_GLOBALS if not hasattr(ps, k)]
    if missing:
        import megatron.core

        raise RuntimeError(
            f"megatron-core {getattr(megatron.core, '__version__', '?')} has no parallel-state "
            f"global {missing[0]} (anyspeed lists 0.16.1's): pin megatron-core==0.16.1"
        )
    return ps


class ParallelState:
    """One complete set of Megatron's parallel-state globals."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    @classmethod
    def current(cls) -> ParallelState:
        """The set in use now."""
        ps = _module()
        return cls({k: getattr(ps, k) for k in STATE_GLOBALS})

    @classmethod
    def build(cls, timeout_minutes: float, **sizes: Any) -> ParallelState:
        """A new set for ``sizes`` (``initialize_model_parallel``'s arguments; none: TP 1, PP 1,
        every rank a data-parallel replica). Every rank must call it; the set in use stays."""
        ps = _module()
        before = cls.current()
        for k, v in before.values.items():
            setattr(ps, k, {} if isinstance(v, dict) else None)
        try:
            ps.initialize_model_parallel(distributed_timeout_minutes=timeout_minutes, **sizes)
            return cls.current()
        finally:
            before._install(ps)

    def _install(self, ps: Any) -> None:
        for k, v in self.values.items():
            setattr(ps, k, v)

    @contextlib.contextmanager
    def entered(self) -> Iterator[ParallelState]:
        """This set in use inside the block; the one in use before it afterwards."""
        ps = _module()
        before = ParallelState.current()
        self._install(ps)
        try:
            yield self
        finally:
            before._install(ps)
