"""``anyspeed pretrain`` runs with checkpoint faults, inside spawned ranks (importable by name).

Each case runs the command's ``main`` (its one-line errors and exit codes) in this rank, with a
fault armed around one checkpoint save on one rank:

* ``"disk"``: the rank's file-size limit drops to 16 KiB (``RLIMIT_FSIZE``, inherited by
  Megatron's writer processes), so writing its files fails in the kernel, as on a full disk;
* ``"permission"``: the ``--save`` directory turns read-only (``chmod 555``); a root process,
  whom modes do not stop, gets the ``EACCES`` the kernel would give anyone else.

``"rng"`` changes a saved RNG state so that restoring it fails on this rank only, while loading.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import resource
import signal
from collections.abc import Iterator
from unittest import mock


@contextlib.contextmanager
def _disk_full() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write, not the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, before)


@contextlib.contextmanager
def _read_only(directory: str) -> Iterator[None]:
    os.makedirs(directory, exist_ok=True)
    os.chmod(directory, 0o555)
    real = os.makedirs

    def makedirs(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if os.path.dirname(os.path.abspath(path)) == os.path.abspath(directory):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real(path, *args, **kwargs)

    try:
        with mock.patch("os.makedirs", makedirs) if os.geteuid() == 0 else contextlib.nullcontext():
            yield
    finally:
        os.chmod(directory, 0o755)


def _armed(kind: str, rank: int, at_save: int, save_dir: str):  # noqa: ANN202
    """A wrapper of ``save_checkpoint`` that arms the fault around save number ``at_save``."""
    from anyspeed.checkpoint import save as save_module

    real, count = save_module.save_checkpoint, [0]

    def save(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        count[0] += 1
        here = int(os.environ["RANK"]) == rank and count[0] == at_save
        fault = contextlib.nullcontext()
        if here:
            fault = _disk_full() if kind == "disk" else _read_only(save_dir)
        with fault:
            return real(*args, **kwargs)

    return mock.patch.object(save_module, "save_checkpoint", save)


def _break_rng(source: str, load_dir: str, rank: int) -> None:
    """Copy checkpoint ``source`` to ``load_dir`` and give ``rank``'s saved RNG state there a
    generator state of the wrong size (every rank waits until it is done)."""
    import shutil

    import torch
    import torch.distributed as dist

    from anyspeed.checkpoint.files import iteration_dir, read_tracker

    if int(os.environ["RANK"]) == 0:
        shutil.copytree(source, load_dir)
    dist.barrier()
    if int(os.environ["RANK"]) == rank:
        rng_dir = os.path.join(iteration_dir(load_dir, read_tracker(load_dir)), "anyspeed_rng")
        path = os.path.join(rng_dir, sorted(os.listdir(rng_dir))[rank])
        state = torch.load(path, weights_only=True)
        state["torch"] = torch.zeros(7, dtype=torch.uint8)
        torch.save(state, path)
    dist.barrier()


def run_cases(cases: list[dict]) -> list[dict]:
    """``main(case["cli"])`` for each case in turn in this process group, with its fault
    (``fault``: kind, rank, save number) or RNG change (``break_rng``: source checkpoint,
    rank); per case the exit code and what this rank wrote to stderr. Cases must fail: a
    success ends the group, and the cases after it are not run."""
    from anyspeed import quiet
    from anyspeed.commands.train import pretrain as main

    os.environ["ANYSPEED_QUIET_NOTICE_SHOWN"] = "1"  # stderr holds only what main says
    quiet.install()  # as the command line does: third-party notices stay hidden
    out = []
    for case in cases:
        cli, err = case["cli"], io.StringIO()
        if "break_rng" in case:
            source, rank = case["break_rng"]
            _break_rng(source, cli[cli.index("--load") + 1], rank)
        armed = contextlib.nullcontext()
        if "fault" in case:
            kind, rank, at_save = case["fault"]
            armed = _armed(kind, rank, at_save, cli[cli.index("--save") + 1])
        with armed, contextlib.redirect_stderr(err):
            code = main(cli)
        out.append({"code": code, "stderr": err.getvalue()})
        if code == 0:  # the group is gone: the test fails on this case, not on a hang
            break
    return out


def async_save_persistent(root: str) -> dict:
    """Megatron's asynchronous save through its persistent worker (a spawned process) against
    its synchronous save of the same sharded state, both loaded back (any number of ranks)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor, load, save
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    dist.init_process_group("gloo")
    ps.initialize_model_parallel()
    rank, world = dist.get_rank(), dist.get_world_size()

    def state() -> dict:
        mine = torch.arange(6.0).view(2, 3) + 10 * rank
        return {"w": ShardedTensor.from_rank_offsets("w", mine, (0, rank, world))}

    paths = {kind: os.path.join(root, kind) for kind in ("async", "sync")}
    if rank == 0:
        for path in paths.values():
            os.makedirs(path)
    dist.barrier()
    calls = AsyncCallsQueue(persistent=True)
    calls.schedule_async_request(save(state(), paths["async"], async_sharded_save=True))
    save(state(), paths["sync"])
    calls.maybe_finalize_async_calls(blocking=True)
    worker = calls.persistent_caller.process
    loaded = {kind: load(state(), path)["w"] for kind, path in paths.items()}
    calls.close()
    del calls  # its caller's __del__ asks for the rank: before the group goes
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return {
        "worker_was_spawned": worker is not None,
        "async_equals_sync": torch.equal(loaded["async"], loaded["sync"]),
        "values": loaded["async"].tolist(),
    }
