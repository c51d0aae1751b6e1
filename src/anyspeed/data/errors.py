"""Exception types that separate bad command lines from bad input records."""

from __future__ import annotations

from anyspeed.errors import UsageError

__all__ = ["DataError", "RecordError", "UsageError"]


class DataError(Exception):
    """Bad data: a bad record under ``--strict``, an unreadable input file, or a run that
    would write nothing (exit code 1)."""


class RecordError(Exception):
    """One input record cannot be used; it is counted under ``reason`` and skipped."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
