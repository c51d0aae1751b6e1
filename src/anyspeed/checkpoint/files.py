"""Megatron's checkpoint-directory convention in one place: tracker, iteration and rank dirs.

``<dir>/latest_checkpointed_iteration.txt`` names the checkpoint a load takes: an iteration
number (the data in ``<dir>/iter_0000020/``) or ``release`` (``<dir>/release/``, a converted,
iteration-less checkpoint). Training, conversion and the HF import all read and write it here.
Writers stage under temporary names (``iter_0000020.tmp``, the tracker's ``.tmp``, a
conversion's ``.NAME.partial-PID``); :func:`remove_stale` clears what killed runs left of them.
A legacy checkpoint holds one ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per rank.

Only the standard library: the lowest layers (the Megatron-LM loader guard in ``features/``,
``data/``) use it too.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

__all__ = [
    "LOCK",
    "RELEASE",
    "TRACKER",
    "DirectoryInUse",
    "iteration_dir",
    "legacy_ranks",
    "lock_dir",
    "lock_holder",
    "pid_alive",
    "rank_dir_name",
    "read_tracker",
    "remove_stale",
    "unlock_dir",
    "write_tracker",
]

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"


def iteration_dir(root: str | os.PathLike[str], iteration: int | str) -> str:
    """``root/iter_0000020`` (or ``root/release``): where one checkpoint's files live."""
    name = RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"
    return os.path.join(os.fspath(root), name)


def read_tracker(root: str | os.PathLike[str]) -> int | str | None:
    """The iteration the tracker names (an int or ``"release"``), None when there is no tracker.

    A tracker holding anything else raises ValueError (one line naming the file).
    """
    path = os.path.join(os.fspath(root), TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        text = fh.read().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"{path}: expected an iteration number or {RELEASE!r}, got {text!r}"
        ) from None


def write_tracker(root: str | os.PathLike[str], iteration: int | str) -> None:
    """Point the tracker at ``iteration`` atomically (write a temporary file, fsync, rename), so a
    kill at any moment leaves either the old or the new tracker."""
    path = os.path.join(os.fspath(root), TRACKER)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(str(iteration))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


_PARTIAL = re.compile(r"^\..+\.partial-(\d+)$")  # a conversion's staging dir, by its process
_STAGED = re.compile(r"^(iter_\d+|release)\.(tmp|old)$")  # a checkpoint being saved or replaced


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (this one included): whose leftovers may be removed."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OverflowError, ValueError):  # not a possible PID
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale(root: str | os.PathLike[str]) -> list[str]:
    """Clear what runs killed mid-write left in ``root`` (returns the names removed or
    restored). Call it from the one process that holds :func:`lock_dir` before its first save.

    ``iter_*.tmp`` / ``release.tmp`` (a save not yet committed), the tracker's ``.tmp`` and
    ``.NAME.partial-PID`` conversions whose process is gone are removed. ``iter_N.old`` is the
    previous copy of a checkpoint being replaced by a save of the same iteration: when
    ``iter_N`` is missing (killed between the two renames) it is renamed back into place, so
    the checkpoint the tracker names is never lost; otherwise it is removed. Complete
    iteration directories, the tracker, the lock and a live process's partial output are
    never touched.
    """
    root = os.fspath(root)
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in sorted(names):
        path = os.path.join(root, name)
        partial, staged = _PARTIAL.match(name), _STAGED.match(name)
        if (
            staged
            and staged.group(2) == "old"
            and not os.path.exists(os.path.join(root, staged.group(1)))
        ):
            os.replace(path, os.path.join(root, staged.group(1)))  # the replaced copy, back
            removed.append(name)
            continue
        if partial:
            stale = not pid_alive(int(partial.group(1)))
        else:
            stale = name == TRACKER + ".tmp" or staged is not None
        if not stale:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
        if not os.path.lexists(path):
            removed.append(name)
    return removed


LOCK = ".anyspeed.lock"


class DirectoryInUse(RuntimeError):
    """Another live run holds the directory's lock."""


def lock_holder(root: str | os.PathLike[str]) -> int | None:
    """The pid of the live process that holds ``root``'s lock, else None (no lock, or its
    holder is gone: the kernel releases a dead process's lock)."""
    import fcntl

    path = os.path.join(os.fspath(root), LOCK)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # held exclusively by someone (this process included)
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        pid = int(text) if text.isdigit() else -1
        return None if pid == os.getpid() else pid
    finally:
        os.close(fd)
    return None


def lock_dir(root: str | os.PathLike[str]) -> int:
    """Hold ``root``'s lock for the life of this process (returns the lock's descriptor; it is
    released when the process ends, even by kill -9). A second run saving to the same
    directory gets :class:`DirectoryInUse` naming the holder's pid."""
    import fcntl

    held = _HELD.get(os.path.realpath(os.fspath(root)))
    if held is not None:  # this process holds it already (runs one after another)
        return held
    os.makedirs(os.fspath(root), exist_ok=True)
    path = os.path.join(os.fspath(root), LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise DirectoryInUse(
            f"{os.fspath(root)} is in use by another run (pid {text or '?'}); "
            "wait for it to end or save elsewhere"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[os.path.realpath(os.fspath(root))] = fd
    return fd


_HELD: dict[str, int] = {}  # this process's locks (kept open: closing would release them)


def unlock_dir(root: str | os.PathLike[str]) -> None:
    """Release this process's lock on ``root`` (a run that ends; tests run several)."""
    fd = _HELD.pop(os.path.realpath(os.fspath(root)), None)
    if fd is not None:
        os.close(fd)


RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def rank_dir_name(t: int, s: int, x: int, pp: int, ep: int) -> str:
    """Megatron-LM's legacy rank directory: ``mp_rank_TT[_PPP][_EEE]`` (PP / EP when > 1)."""
    return f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") + (f"_{x:03d}" if ep > 1 else "")


def legacy_ranks(
    it_dir: str | os.PathLike[str], expert_parallel: bool
) -> dict[tuple[int, int, int], Path]:
    """(tp, pp, ep) rank -> file. ``mp_rank_TT_NNN`` is a pipeline stage unless the checkpoint
    was saved with expert parallelism and no pipeline (Megatron-LM writes both alike)."""
    ranks = {}
    for p in Path(it_dir).iterdir():
        if mt := RANK_DIR.match(p.name):
            t, a, b = int(mt.group(1)), int(mt.group(2) or 0), int(mt.group(3) or 0)
            key = (t, 0, a) if expert_parallel and mt.group(3) is None else (t, a, b)
            ranks[key] = p / "model_optim_rng.pt"
    return ranks
