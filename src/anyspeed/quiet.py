"""Quiet by default: third-party notices that every portable run triggers stay hidden.

Without Transformer Engine and Apex, Megatron-Core warns at import and at model build that it
falls back to local implementations; torch.distributed and Megatron's checkpointing emit
deprecation notices about each other; Megatron hints at ``CUDA_DEVICE_MAX_CONNECTIONS``. None of
them asks the user to do anything. :func:`install` hides exactly these (warnings and logging
records), and the first time it hides a warning, rank 0 prints one line saying what was switched
off.
``ANYSPEED_VERBOSE=1`` shows everything. Ranks run anyspeed's own command line, which calls
:func:`install` again, so every process of a run is quiet alike.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import warnings
from typing import Any, TextIO

ENV = "ANYSPEED_VERBOSE"
# Set once the one-line notice has been printed, so that child processes do not repeat it.
_SHOWN_ENV = "ANYSPEED_QUIET_NOTICE_SHOWN"

_MEGATRON = f"{os.sep}megatron{os.sep}"
_TORCH_DIST = f"{os.sep}torch{os.sep}distributed{os.sep}"
_DEPRECATIONS = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)

# (categories, message pattern, path fragment of the file the warning points at, or None).
_WARNINGS: tuple[tuple[tuple[type[Warning], ...], re.Pattern[str], str | None], ...] = (
    ((UserWarning,), re.compile(r"(Transformer Engine|Apex)\b.*\bnot installed"), _MEGATRON),
    ((UserWarning,), re.compile(r"absl\.logging is not installed"), _MEGATRON),
    ((UserWarning,), re.compile(r"CUDA_DEVICE_MAX_CONNECTIONS"), _MEGATRON),
    ((UserWarning,), re.compile(r"full scope is deprecated"), _MEGATRON),
    # --moe-grouped-gemm runs the "legacy" GroupedMLP through anyspeed's portable kernel.
    ((UserWarning,), re.compile(r"The legacy GroupedMLP will be deprecated"), _MEGATRON),
    ((UserWarning,), re.compile(r"The \.grad attribute of a Tensor that is not a leaf"), _MEGATRON),
    (_DEPRECATIONS, re.compile(""), _TORCH_DIST),
    (_DEPRECATIONS, re.compile(""), _MEGATRON),
    (
        _DEPRECATIONS,
        re.compile(r"`torch\.distributed\.|ShardedTensor|`(load|save)_state_dict` is deprecated"),
        None,
    ),
)
# Megatron's logging records of the same kind: (logger-name prefix, message pattern).
_RECORDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("megatron", re.compile(r"(Transformer Engine|Apex)\b.*\bnot installed")),
    ("megatron", re.compile(r"indexes because path_to_cache is None")),
    ("megatron", re.compile(r"You're using the legacy tokenizer system")),
    # LLaVAModel's banner: anyspeed's docs/multimodal.md says what it supports and checks.
    ("megatron", re.compile(r"LLaVA is work in progress")),
    # ``--data-path 1 PREFIX``: a blend of one dataset, as asked (MindSpeed-LLM's scripts).
    ("megatron", re.compile(r"Building a BlendedDataset for a single MegatronDataset")),
)

_original_showwarning: Any = None


def verbose() -> bool:
    """Whether ``ANYSPEED_VERBOSE`` asks for every third-party warning (1/true/yes/on)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def install() -> None:
    """Hide the known third-party notices in this process (unless verbose); idempotent."""
    global _original_showwarning
    if verbose():
        return
    # transformers' "Loading weights" bars (read through huggingface_hub's switch at import)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if warnings.showwarning is not _showwarning:
        _original_showwarning = warnings.showwarning
        warnings.showwarning = _showwarning
    handlers = [logging.lastResort, *logging.getLogger().handlers]
    for handler in handlers:
        if handler is not None and not any(isinstance(f, _RecordFilter) for f in handler.filters):
            handler.addFilter(_RecordFilter())


def notice() -> str:
    """anyspeed's own line about what the hidden notices were about."""
    missing = [
        name
        for name, module in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
        if importlib.util.find_spec(module) is None
    ]
    if not missing:
        return f"anyspeed: third-party notices hidden ({ENV}=1 shows them)"
    return (
        f"anyspeed: {' and '.join(missing)} not installed: using the portable local spec "
        f"({ENV}=1 shows third-party warnings)"
    )


def _hidden_warning(message: Warning | str, category: type[Warning], filename: str) -> bool:
    text = str(message)
    return any(
        issubclass(category, kinds)
        and pattern.search(text)
        and (where is None or where in filename)
        for kinds, pattern, where in _WARNINGS
    )


def _showwarning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` that drops the known notices and passes on the rest."""
    if _hidden_warning(message, category, filename):
        _announce()
        return
    _original_showwarning(message, category, filename, lineno, file, line)


class _RecordFilter(logging.Filter):
    """Drops Megatron's logging records of the kinds hidden (silently: the warnings announce)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(record.name.startswith(p) and rx.search(text) for p, rx in _RECORDS)


def _announce() -> None:
    """Print :func:`notice` once per run, from rank 0 only."""
    if os.environ.get(_SHOWN_ENV) or os.environ.get("RANK", "0") != "0":
        return
    os.environ[_SHOWN_ENV] = "1"
    print(notice(), file=sys.stderr, flush=True)
