"""Megatron's checkpoint-directory convention in one place: the tracker file and iteration dirs.

``<dir>/latest_checkpointed_iteration.txt`` names the checkpoint a load takes: an iteration
number (the data in ``<dir>/iter_0000020/``) or ``release`` (``<dir>/release/``, a converted,
iteration-less checkpoint). Training, conversion and the HF import all read and write it here.
Writers stage under temporary names (``iter_0000020.tmp``, the tracker's ``.tmp``, a
conversion's ``.NAME.partial-PID``); :func:`remove_stale` clears what killed runs left of them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil

__all__ = ["RELEASE", "TRACKER", "iteration_dir", "read_tracker", "remove_stale", "write_tracker"]

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
    """Remove what runs killed mid-write left in ``root`` (returns the names removed).

    That is ``iter_*.tmp`` / ``release.tmp`` checkpoints being saved (``.old``: being
    replaced by a save of the same iteration), the tracker's ``.tmp``,
    and ``.NAME.partial-PID`` conversions whose process is gone; complete iteration
    directories, the tracker and a live process's partial output are never touched. Call it
    from one process (rank 0) before that run's first save.
    """
    root = os.fspath(root)
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in sorted(names):
        path = os.path.join(root, name)
        partial = _PARTIAL.match(name)
        if partial:
            pid = int(partial.group(1))
            stale = not pid_alive(pid)
        else:
            stale = name == TRACKER + ".tmp" or _STAGED.match(name) is not None
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
