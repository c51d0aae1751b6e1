"""One kind of usage error for every command: a one-line message, exit code 2.

A bad flag, path or input found before any work starts is a :class:`UsageError` naming the flag
or file and what would fix it; :class:`OneLineArgumentParser` turns argparse's own complaints into
one; :func:`report` prints it the same way for every command.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class UsageError(ValueError):
    """A bad flag, path or input found before work starts (one line; exit code 2)."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of printing usage and exiting.

    A command with its own subclass of UsageError sets ``error_type`` to it.
    """

    error_type: type[UsageError] = UsageError

    def error(self, message: str) -> NoReturn:
        raise self.error_type(message)


def report(prog: str, exc: BaseException, code: int = 2) -> int:
    """Print ``<prog>: error: <message>`` (first line only) to stderr; return ``code`` (2).

    ``code`` is for the errors found once work has started (bad data, a failed conversion: 1).
    """
    text = str(exc).strip()
    message = text.splitlines()[0] if text else type(exc).__name__
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return code
