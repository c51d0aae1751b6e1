"""One typed run: the parsed flags (frozen) and the typed parts every component reads.

A command line is parsed once, its derived flag values are completed, and the namespace is
then frozen: a later write raises, so no component can hide state in it. What checks produce
(model, layout, training settings, tokenizer, the checkpoint to load, the stage's own config
and data) lives in :class:`Run`, which is never mutated either.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from anyspeed.layout import Layout
from anyspeed.models.config import ModelConfig
from anyspeed.training.config import TrainConfig


class ParsedArgsWrite(AttributeError):
    """Code wrote onto the parsed command line after parsing (a bug, not a user error)."""


class FrozenArgs(argparse.Namespace):
    """A parsed namespace that refuses writes: reading is as before; rewriting a value to
    what it already is (a parse-time rewrite applied twice) is allowed, any change is not."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ and _same(self.__dict__[name], value):
            return
        raise ParsedArgsWrite(
            f"the parsed command line is read-only after parsing: tried to set args.{name} = "
            f"{value!r}; keep derived state in the Run"
        )

    def __delattr__(self, name: str) -> None:
        raise ParsedArgsWrite(f"the parsed command line is read-only: tried to delete {name}")


def _same(old: Any, new: Any) -> bool:
    try:
        return type(old) is type(new) and bool(old == new)
    except Exception:  # e.g. tensors: ambiguous truth value
        return old is new


def freeze(args: argparse.Namespace) -> argparse.Namespace:
    """Make ``args`` read-only in place (and return it)."""
    if not isinstance(args, FrozenArgs):
        args.__class__ = FrozenArgs
    return args


def thawed(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    """A writable copy of ``args`` with ``changes`` (tests and tools that vary one flag)."""
    return argparse.Namespace(**{**vars(args), **changes})


@dataclass(frozen=True)
class Run:
    """Everything a checked command line describes; what the engine, tasks and hooks read.

    ``args`` keeps the (frozen) flags for settings that have no typed home yet (logging,
    schedule); ``config`` is the stage's own settings, ``data`` the stage's opened data, and
    ``records`` what every checkpoint of the run stores beside the model record.
    """

    stage: str
    prog: str
    args: argparse.Namespace
    model: ModelConfig
    layout: Layout
    train: TrainConfig
    world: int
    tokenizer: Any = None
    load: str | None = None  # the checkpoint to start from (a converted HF dir included)
    hf_dir: str | None = None  # --load named this Hugging Face directory
    config: Any = None
    data: Any = None
    records: Mapping[str, Any] = field(default_factory=dict)
    export: Any = None  # the Hugging Face export after each save (hf_export.Export), None: off

    @property
    def dp(self) -> int:
        return self.layout.dp(self.world)

    @property
    def seq_length(self) -> int:
        return self.train.seq_length
