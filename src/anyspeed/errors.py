"""One kind of usage error for every command: a one-line message, exit code 2.

A bad flag, path or input found before any work starts is a :class:`UsageError` naming the flag
or file and what would fix it; :class:`OneLineArgumentParser` turns argparse's own complaints into
one; :func:`report` prints it the same way for every command.
"""

from __future__ import annotations

import argparse
import sys


class UsageError(ValueError):
    """A bad flag, path or input found before work starts (one line; exit code 2)."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def report(prog: str, exc: BaseException) -> int:
    """Print ``<prog>: error: <message>`` (first line only) to stderr; return exit code 2."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return 2
