"""Range checks of the stages' numeric flags: one line naming the flag and what would fix it."""

from __future__ import annotations

from anyspeed.errors import UsageError


def check_range(flag: str, value: float) -> None:
    """A value in [0, 0.5) (a label smoothing or a clip ratio)."""
    if not 0 <= value < 0.5:
        raise UsageError(f"{flag} {value} is out of range: give a value in [0, 0.5)")


def check_positive(flag: str, value: float) -> None:
    """A value above 0."""
    if not value > 0:
        raise UsageError(f"{flag} {value}: give a positive value")
