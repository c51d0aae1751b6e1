"""What a checkpoint read, check, load or save raises: one line each, naming the file or fix."""

from __future__ import annotations

from anyspeed.errors import UsageError


class CheckpointFileError(UsageError):
    """One file of a checkpoint is missing, truncated or unreadable (one line naming it)."""


class ModelRecordError(UsageError):
    """A checkpoint's model record (or ``--model-type-hf``) names no model anyspeed builds."""


class CheckpointError(ValueError):
    """A checkpoint could not be loaded or saved: one line, raised on every rank alike."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint under ``--load`` does not fit this run or a file of it is broken (one line
    naming the fix or the file)."""


class CheckpointSaveError(CheckpointError):
    """A save failed (disk full, permission): the last good checkpoint and tracker stand."""


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
