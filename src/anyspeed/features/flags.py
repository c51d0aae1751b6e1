"""The features' flags: added to a full parser, or parsed on their own.

The registry (:mod:`.registry`) binds these to the process's features.

* :func:`add_arguments` is what Megatron-LM's parser and ``anyspeed pretrain``'s get:
  ``--optimization-level`` and every feature's own flags, each only when the parser lacks it.
* :func:`build_parser` / :func:`parse_args` parse a command line on their own (the import-time
  shim, ``anyspeed features``): the features' flags plus, type-only, the Megatron-LM flags that
  features and the layout check read (:data:`MEGATRON_FLAGS`). Other flags are ignored.

Features then read the parsed namespace (``getattr(args, name, default)``), never raw argv.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from anyspeed.features.base import (
    DEFAULT_OPTIMIZATION_LEVEL,
    OPTIMIZATION_LEVELS,
    ArgumentParser,
    Feature,
    add_flag,
)

# Megatron-LM flags that features and the layout check read but do not own: (flag, type), bool
# for a switch. The one list; a full parser (Megatron-LM's, pretrain's) defines them itself.
MEGATRON_FLAGS: tuple[tuple[str, type], ...] = (
    ("--tensor-model-parallel-size", int),
    ("--pipeline-model-parallel-size", int),
    ("--num-layers-per-virtual-pipeline-stage", int),
    ("--decoder-first-pipeline-num-layers", int),
    ("--decoder-last-pipeline-num-layers", int),
    ("--num-layers", int),
    ("--num-attention-heads", int),
    ("--group-query-attention", bool),
    ("--num-query-groups", int),
    ("--seq-length", int),
    ("--sequence-parallel", bool),
    ("--use-distributed-optimizer", bool),
    ("--overlap-grad-reduce", bool),
    ("--overlap-param-gather", bool),
    ("--ddp-bucket-size", int),
    ("--num-experts", int),
    ("--expert-model-parallel-size", int),
    ("--expert-tensor-parallel-size", int),
    ("--moe-token-dispatcher-type", str),
    ("--cuda-graph-impl", str),
    ("--enable-cuda-graph", bool),
    ("--tp-comm-overlap", bool),
    ("--bf16", bool),
)


def _level(value: str) -> int:
    try:
        level = int(value)
    except ValueError:
        level = -1
    if level not in OPTIMIZATION_LEVELS:
        raise argparse.ArgumentTypeError(
            f"--optimization-level must be 0, 1 or 2 (got {value!r}): 0 = device compatibility "
            "only, 1 = + device-affine kernels, 2 = + accelerated features"
        )
    return level


def add_arguments(
    parser: argparse._ActionsContainer, feats: Sequence[Feature]
) -> argparse._ActionsContainer:
    """Add ``--optimization-level`` and the flags of each of ``feats`` to ``parser`` (e.g.
    Megatron-LM's); a flag the parser already defines keeps its definition."""
    group = parser.add_argument_group("anyspeed")
    add_flag(
        group,
        "--optimization-level",
        type=_level,
        default=DEFAULT_OPTIMIZATION_LEVEL,
        help="0: device compatibility only; 1: + device-affine kernels; "
        "2: + accelerated features, each enabled by its own flag (default 2)",
    )
    for feature in feats:
        feature.add_arguments(group)
    return parser


def build_parser(feats: Sequence[Feature]) -> ArgumentParser:
    """The standalone parser: ``feats``' flags and, type-only, :data:`MEGATRON_FLAGS`."""
    parser = ArgumentParser(prog="anyspeed", add_help=False, allow_abbrev=False)
    group = parser.add_argument_group("Megatron-LM flags read by anyspeed")
    for flag, kind in MEGATRON_FLAGS:
        if kind is bool:
            group.add_argument(flag, action="store_true", default=False, help=argparse.SUPPRESS)
        else:
            group.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)
    add_arguments(parser, feats)
    return parser


def parse_args(argv: Sequence[str], feats: Sequence[Feature]) -> argparse.Namespace:
    """Parse the flags anyspeed reads out of ``argv`` (other flags are Megatron's: ignored)."""
    args, _ = build_parser(feats).parse_known_args(list(argv))
    return args
