"""Starting local ranks: a free port, the torchrun command line, a world of one.

``anyspeed pretrain --nproc-per-node N`` starts its ranks through :func:`torchrun_command`, in
the environment :func:`torchrun_env` returns, under :func:`supervise` (a signal to it ends
every process it started); a run without a launcher makes itself rank 0 of a world of one
with :func:`single_process_env`.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PORTS = random.SystemRandom()  # not the global generator: a run's seed would repeat its draws


def free_port() -> int:
    """A TCP port on localhost that is free right now, drawn below the ephemeral range: a port
    the kernel hands out (bind to 0) can be taken next as the source port of any outgoing
    connection, such as another job's rendezvous, before the rank binds it."""
    for _ in range(64):
        port = _PORTS.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, module: str, argv: list[str]) -> list[str]:
    """torchrun (``--standalone --nproc-per-node=N -m module argv...``) through
    :func:`torchrun_main`, which turns a rank's death into one line."""
    return [
        sys.executable,
        "-m",
        "anyspeed.launch",
        f"anyspeed {argv[0]}" if argv else module,
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *argv,
    ]


def torchrun_main(argv: list[str]) -> int:
    """``python -m anyspeed.launch PROG TORCHRUN-ARGS...``: torchrun itself, quiet. A rank that
    ended with exit code 1 has said why in one line; one killed by a signal (or ending with
    another code) gets one line here, instead of torchrun's log lines and traceback."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    prog, rest = argv[0], argv[1:]
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(rest))
    except ChildFailedError as exc:
        # A rank that exits 1 has said why; the others' deaths are what this line is for.
        unsaid = {r: f for r, f in exc.failures.items() if f.exitcode != 1}
        if not unsaid:
            return 1
        rank = min(unsaid, key=lambda r: unsaid[r].timestamp)
        failure = unsaid[rank]
        how = (
            f"was killed by {failure.signal_name()}"
            if failure.exitcode < 0
            else f"ended with exit code {failure.exitcode}"
        )
        print(
            f"{prog}: error: rank {rank} (pid {failure.pid}) {how}; every rank has stopped "
            "(checkpoints already written are complete)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


def torchrun_env(nproc: int) -> dict[str, str]:
    """This process's environment for the launcher, with ``OMP_NUM_THREADS=1`` when unset and
    ``nproc > 1``: torchrun's own default for its ranks, set here so it has no banner to print."""
    env = dict(os.environ)
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env[LAUNCHED] = "1"  # the launcher already printed the pre-start notices
    return env


LAUNCHED = "ANYSPEED_LAUNCHED"


def reports_here() -> bool:
    """Whether this process prints a pre-start notice: the launcher, a lone process, or rank 0
    under a launcher the user started (not under ours, which already printed it)."""
    if os.environ.get(LAUNCHED):
        return False
    return os.environ.get("RANK", "0") == "0"


def single_process_env() -> dict[str, str]:
    """The launcher environment of rank 0 in a world of one (a fresh local port)."""
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }


def _track(proc: subprocess.Popen, seen: dict[int, Any]) -> None:
    """Add ``proc``'s live descendants to ``seen`` (pid -> psutil.Process)."""
    import psutil

    try:
        for p in psutil.Process(proc.pid).children(recursive=True):
            seen.setdefault(p.pid, p)
    except psutil.Error:
        pass


def _signal_all(seen: dict[int, Any], sig: int) -> bool:
    """Send ``sig`` to every live process in ``seen`` and to its process group (ranks run in
    their own sessions; their helper processes share the rank's group). True if any lived."""
    import psutil

    alive = False
    for p in list(seen.values()):
        try:
            if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                continue  # is_running compares creation times: never a reused pid
            alive = True
            pgid = os.getpgid(p.pid)
            if pgid != os.getpgrp():
                os.killpg(pgid, sig)
            p.send_signal(sig)
        except (psutil.Error, OSError):
            pass
    return alive


def supervise(cmd: list[str], env: dict[str, str], prog: str, grace_s: float = 10.0) -> int:
    """Run the launcher ``cmd`` (torchrun) in its own session and return its exit code.

    On SIGTERM, SIGINT or SIGHUP the launcher is killed (it would print a traceback and give
    its ranks 30 s), every process it started gets SIGTERM, and what still lives ``grace_s``
    seconds later gets SIGKILL; the exit code is then 128 + signal, with one line on stderr.
    Either way no process it started is left behind.
    """
    got: list[int] = []
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    handle = threading.current_thread() is threading.main_thread()  # signals reach it only
    old = {s: signal.signal(s, lambda n, f: got.append(n)) for s in FORWARDED if handle}
    seen: dict[int, Any] = {}
    try:
        while proc.poll() is None and not got:
            _track(proc, seen)
            time.sleep(0.2)
        if got:
            _track(proc, seen)
            proc.kill()
            deadline = time.monotonic() + grace_s
            while _signal_all(seen, signal.SIGTERM) and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        _track(proc, seen)
        _signal_all(seen, signal.SIGKILL)  # stragglers: ranks, their checkpoint writers
        proc.wait()
        for s, handler in old.items():
            signal.signal(s, handler)
    if got:
        name = signal.Signals(got[0]).name
        print(
            f"{prog}: stopped by {name}; torchrun and every rank it started have ended",
            file=sys.stderr,
            flush=True,
        )
        return 128 + got[0]
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(torchrun_main(sys.argv[1:]))
