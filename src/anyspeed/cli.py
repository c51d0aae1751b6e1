"""``anyspeed`` command line: ``pretrain``, ``posttrain``, ``preprocess``, ``convert``,
``features`` and more (the command modules live in ``anyspeed.commands``).

``anyspeed features [TRAINING FLAGS...]`` lists every feature with its level, flags and
availability on this device; given a training command line it also says which features would
be on and every patch they would apply. ``anyspeed pretrain --mock-data`` trains without data.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from anyspeed.errors import UsageError, report


def _check_training_flags(argv: Sequence[str]) -> None:
    """UsageError (one line) for a flag neither ``anyspeed pretrain`` nor a feature defines
    (misspelled ones name the closest), a bad value, or a number out of its range."""
    from anyspeed.features import build_parser as features_parser
    from anyspeed.stages.arguments import build_parser, unsupported_flag
    from anyspeed.stages.ranges import check_ranges

    pretrain = build_parser()
    bad = unsupported_flag(argv, pretrain, features_parser(), prog="anyspeed features")
    if bad:
        raise UsageError(bad)
    args, _ = pretrain.parse_known_args(list(argv))  # Megatron-LM-only feature flags: extras
    check_ranges(args, pretrain)


def _features_report(argv: Sequence[str], as_json: bool) -> int:
    """``anyspeed features``: its training flags are checked as ``anyspeed pretrain``'s are."""
    from anyspeed.features import report as features

    if "-h" in argv or "--help" in argv:
        print(
            "usage: anyspeed features [--json] [TRAINING FLAGS...]: every feature, its level, "
            "flags and availability; with `anyspeed pretrain` flags also whether it is on and "
            "the patches it applies"
        )
        return 0
    try:  # FeatureError is a UsageError
        _check_training_flags(argv)
        rep = features.build(argv)
    except UsageError as exc:
        return report("anyspeed features", exc)
    print(json.dumps(rep, indent=1) if as_json else features.text(rep, with_patches=bool(argv)))
    return 0


def _models(argv: Sequence[str]) -> int:
    """``anyspeed models``: every preset, its family and size (it takes no flags)."""
    from anyspeed.models.presets import PRESETS

    if "-h" in argv or "--help" in argv:
        print(
            "usage: anyspeed models: every architecture preset (--model NAME), its family "
            "and parameter count"
        )
        return 0
    if argv:
        return report(
            "anyspeed models",
            UsageError(f"unrecognized arguments: {' '.join(argv)} (it takes no flags)"),
        )
    width = max(len(p.family) for p in PRESETS.values())
    for name, p in PRESETS.items():
        print(f"{name:<16} {p.family:<{width}} {p.num_parameters() / 1e6:>10,.1f}M params")
    return 0


def _run(module: str, function: str = "main", prefix: Sequence[str] = (), megatron: bool = True):
    """A command that imports ``module`` only when it runs (start-up stays fast); ``megatron``:
    it may import Megatron-Core (the commands without torch say False)."""

    def call(argv: Sequence[str]) -> int:
        import importlib

        if megatron:  # (anyspeed.device imports torch)
            from anyspeed.device import forced_type
            from anyspeed.device.jit import keep_megatron_jit_off

            try:
                forced_type()  # a bad ANYSPEED_DEVICE: one line, before any work
            except UsageError as exc:
                return report("anyspeed", exc)

            # Commands read data and checkpoints with Megatron-Core's code before the adaptor
            # is applied: its jit_fuser would import TorchDynamo (1.3 s) on a device without
            # CUDA, which never calls the functions it decorates.
            keep_megatron_jit_off(unless_cuda=True)
        return getattr(importlib.import_module(module), function)([*prefix, *argv])

    return call


COMMANDS = {
    "demo": _run("anyspeed.demo"),
    "pretrain": _run("anyspeed.commands.train", "pretrain"),
    "posttrain": _run("anyspeed.commands.train", "posttrain"),
    "fsdp2": _run("anyspeed.commands.fsdp2"),
    "preprocess": _run("anyspeed.commands.preprocess", prefix=["preprocess"], megatron=False),
    "train-tokenizer": _run(
        "anyspeed.commands.preprocess", prefix=["train-tokenizer"], megatron=False
    ),
    "convert": _run("anyspeed.commands.convert"),
    "models": _models,
    "memory": _run("anyspeed.commands.memory"),
    "generate": _run("anyspeed.commands.generate"),
    "evaluate": _run("anyspeed.commands.evaluate"),
    "verify": _run("anyspeed.commands.verify"),
    "features": lambda argv: _features_report([a for a in argv if a != "--json"], "--json" in argv),
}

# What ``anyspeed --help`` says of each command (a test holds it to COMMANDS).
USAGE = {
    "demo": "demo [--sft | --dpo | --grpo | --mm | --moe]",
    "pretrain": "pretrain [--nproc-per-node N] FLAGS...",
    "posttrain": "posttrain --stage sft|dpo|simpo|orm|grpo|vlm [--nproc-per-node N] FLAGS...",
    "fsdp2": "fsdp2 CONFIG.yaml [--nproc-per-node N] [--section.key VALUE ...]",
    "preprocess": "preprocess ...",
    "train-tokenizer": "train-tokenizer ...",
    "convert": "convert ...",
    "models": "models",
    "memory": "memory [--fits GiB] [--world-size N] TRAINING FLAGS...",
    "generate": "generate --load DIR ...",
    "evaluate": "evaluate --load DIR --task T ...",
    "verify": "verify [--steps N] [--reference FLAGS] pretrain|posttrain FLAGS...",
    "features": "features [--json] [TRAINING FLAGS...]",
}


def help_text() -> str:
    """``anyspeed --help``: the module's description and every command of COMMANDS."""
    usage = "".join(f"\n  anyspeed {USAGE.get(name, name)}" for name in COMMANDS)
    return f"{__doc__.strip()}\n\ncommands:{usage}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``anyspeed`` command (and of ``python -m anyspeed``)."""
    from anyspeed import quiet

    quiet.install()  # before Megatron is imported: its expected fallback notices stay hidden
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        from anyspeed import __version__

        print(f"anyspeed {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        return report(
            "anyspeed", UsageError(f"unknown command {cmd!r} (try: {', '.join(COMMANDS)})")
        )
    return COMMANDS[cmd](rest)


if __name__ == "__main__":
    raise SystemExit(main())
