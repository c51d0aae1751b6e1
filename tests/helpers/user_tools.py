"""Tools for the multi-turn rollout tests (``--tools helpers.user_tools:multiply``)."""

from __future__ import annotations


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b
