"""User functions named on the command line (``module:function``) or built-in by name: the
reward functions of ``--verifier-function`` and the tools of ``--tools``, imported before start
so that a bad name is one line naming the flag."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from anyspeed.errors import UsageError


def load_callable(
    name: str, builtin: Mapping[str, Callable[..., Any]], flag: str, kind: str
) -> Callable[..., Any]:
    """``builtin[name]``, or the callable a ``module:function`` path names (dotted attributes
    allowed); a UsageError naming ``flag`` and ``kind`` (e.g. "reward") otherwise."""
    if name in builtin:
        return builtin[name]
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise UsageError(
            f"{flag}: unknown {kind} {name!r}; use one of "
            f"{', '.join(sorted(builtin))} or a 'module:function' path"
        )
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:
        text = str(exc).strip()
        why = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
        raise UsageError(f"{flag} {name!r}: cannot import {module_name!r} ({why})") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{flag} {name!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{flag} {name!r}: is a {type(obj).__name__}, not a function")
    return obj
