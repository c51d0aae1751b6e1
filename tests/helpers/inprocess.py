"""Commands run in the test process itself: what a successful run leaves behind (Megatron's
parallel state, the adaptor's patches, the launcher variables it set) is undone afterwards, so
later tests start clean."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def clean_after() -> Iterator[None]:
    env = dict(os.environ)
    try:
        yield
    finally:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from anyspeed import adaptor

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        adaptor.undo()
        os.environ.clear()
        os.environ.update(env)
