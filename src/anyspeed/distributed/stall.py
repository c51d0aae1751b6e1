"""A collective that timed out: one line naming the rank that did not answer; every rank exits.

When the process group starts, each rank writes its host and pid into the group's store
(:func:`register`). A rank whose collective times out checks in under a stall key and waits
until the check-ins settle: the ranks that never check in are the stalled ones. The lowest rank
that checked in prints the line; stalled ranks on this host that share its launcher are ended
with SIGKILL (a stopped process never acts on torchrun's SIGTERM, which torchrun would follow
with SIGKILL only 30 s later). Every rank that checked in then exits with code 1.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import Any, NoReturn

PREFIX = "anyspeed/stall"
# Check-ins unchanged this long mean the ranks still missing are stalled: a tenth of the timeout
# (ranks waiting on the stalled one time out about as far apart as they started waiting),
# at least SETTLE_S and at most MAX_SETTLE_S seconds.
SETTLE_S = 2.0
MAX_SETTLE_S = 30.0


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def register() -> None:
    """Record this rank's host, pid and parent pid in the process group's store."""
    try:
        _store().set(
            f"{PREFIX}/pid/{_rank()}", f"{socket.gethostname()} {os.getpid()} {os.getppid()}"
        )
    except Exception:  # noqa: BLE001 - only the stall report loses its detail
        pass


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective (or store) timing out, by the backends' wording."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)


def is_peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that lost a peer (its process ended: killed, crashed)."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text
        for s in (
            "connection reset by peer",
            "connection closed by peer",
            "broken pipe",
            "connection refused",
        )
    )


def exit_on_lost_peer(prog: str) -> NoReturn:
    """After a collective lost a peer: one line (unless our launcher reports the rank that
    ended), exit 1 at once without tearing down the broken group."""
    if not os.environ.get("ANYSPEED_LAUNCHED"):
        print(
            f"{prog}: error: rank {_rank()} lost contact with another rank (its process "
            "ended); stopping (checkpoints already written are complete)",
            file=sys.stderr,
            flush=True,
        )
    sys.stdout.flush()
    os._exit(1)


def _settle(store: Any, world: int, settle_s: float) -> set[int]:
    """The ranks that checked in, once no new one arrived for ``settle_s`` seconds (one
    counter is polled, so a large job does not flood the store)."""
    count = 0
    start = last_change = time.monotonic()
    while time.monotonic() - start < 4 * settle_s:
        now = store.add(f"{PREFIX}/count", 0)
        if now != count:
            count, last_change = now, time.monotonic()
        if count >= world or time.monotonic() - last_change >= settle_s:
            break
        time.sleep(0.2)
    return {r for r in range(world) if store.check([f"{PREFIX}/in/{r}"])}


def _end_local(store: Any, stalled: list[int]) -> None:
    """SIGKILL the stalled ranks that run on this host under this rank's launcher."""
    import psutil

    for r in stalled:
        try:
            host, pid, ppid = store.get(f"{PREFIX}/pid/{r}").decode().split()
            if host != socket.gethostname() or int(ppid) != os.getppid() or int(ppid) == 1:
                continue
            proc = psutil.Process(int(pid))
            for p in [*proc.children(recursive=True), proc]:
                p.send_signal(signal.SIGKILL)
        except Exception:  # noqa: BLE001 - gone already, or not ours: the launcher ends it
            continue


def exit_on_stall(prog: str, minutes: float) -> NoReturn:
    """After a timed-out collective: name the stalled rank(s) (lowest live rank prints one
    line), end the local stalled ranks, exit 1 without tearing down the dead group."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), _rank()
    store, alive, stalled = None, {rank}, []
    try:
        store = _store()
        store.set_timeout(timedelta(seconds=10))
        store.set(f"{PREFIX}/in/{rank}", "1")
        store.add(f"{PREFIX}/count", 1)
        settle = min(MAX_SETTLE_S, max(SETTLE_S, 6.0 * minutes))  # 6 s per minute: a tenth
        alive = _settle(store, world, settle) | {rank}
        stalled = sorted(set(range(world)) - alive)
    except Exception:  # noqa: BLE001 - the store itself is gone: say what is known
        pass
    if rank == min(alive):
        within = f"within {minutes:g} minutes (--distributed-timeout-minutes)"
        if stalled:
            who = ("rank " if len(stalled) == 1 else "ranks ") + ", ".join(map(str, stalled))
            message = f"{who} did not answer {within}; every rank stops"
        else:
            message = f"a collective did not complete {within}; every rank stops"
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        if store is not None and stalled:
            _end_local(store, stalled)
    sys.stdout.flush()
    os._exit(1)  # a group with a stalled member cannot be destroyed cleanly
