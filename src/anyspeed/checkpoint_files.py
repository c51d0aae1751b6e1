"""Megatron's checkpoint-directory convention in one place: the tracker file and iteration dirs.

``<dir>/latest_checkpointed_iteration.txt`` names the checkpoint a load takes: an iteration
number (the data in ``<dir>/iter_0000020/``) or ``release`` (``<dir>/release/``, a converted,
iteration-less checkpoint). Training, conversion and the HF import all read and write it here.
"""

from __future__ import annotations

import os

__all__ = ["RELEASE", "TRACKER", "iteration_dir", "read_tracker", "write_tracker"]

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
