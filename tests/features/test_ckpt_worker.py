"""Megatron's asynchronous save through its persistent worker process.

``AsyncCallsQueue(persistent=True)`` (Megatron-LM's ``--async-save`` needs
``--use-persistent-ckpt-worker``) saves in a *spawned* process, a fresh interpreter: without
the one line there, its ``torch.cuda.set_device(rank % torch.cuda.device_count())`` divided by
zero and the trainer waited forever (``dist_checkpointing/test_async_save.py`` in Megatron's
unit tests). Under anyspeed the worker applies the one line first; what it saves loads back
equal to Megatron's synchronous save of the same state, on a gloo rank.
"""

from __future__ import annotations

from anyspeed.testing import run_distributed
from helpers import checkpoint_ranks


def test_persistent_worker_saves_like_the_synchronous_save(tmp_path):
    results = run_distributed(
        checkpoint_ranks.async_save_persistent, 1, root=str(tmp_path), timeout=300, fresh=True
    )
    (res,) = results  # one rank: each rank's worker is a fresh interpreter (the slow part)
    assert res["worker_was_spawned"] and res["async_equals_sync"], res
    assert res["values"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
