"""Features: named units of behaviour with a level, CLI flags, validation and patches.

Optimization levels follow MindSpeed: 0 = device compatibility only; 1 = + device-affine kernels
(on by default where available); 2 = + accelerated features, each switched on by its own flag.
A feature states on which devices it is available and why not elsewhere; asking for an
unavailable one is a one-line error naming the flag, raised before any process group starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from anyspeed.device import DeviceInfo
from anyspeed.patching import PatchManager

__all__ = [
    "Feature",
    "FeatureError",
    "ArgumentParser",
    "FEATURES",
    "register_feature",
    "build_parser",
    "parse_args",
    "add_arguments",
    "enabled_features",
    "validate",
]

OPTIMIZATION_LEVELS = (0, 1, 2)
DEFAULT_OPTIMIZATION_LEVEL = 2


class FeatureError(ValueError):
    """Bad or unavailable feature request; the message is one line naming the flag and the fix."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises FeatureError (one line) instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise FeatureError(message)


class Feature:
    """Base class. Subclasses set ``name``, ``level``, ``description`` and override hooks."""

    name: str = ""
    level: int = 0
    description: str = ""
    flags: tuple[str, ...] = ()  # the command-line flags this feature owns or inspects

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        """Add this feature's flags (only those Megatron-LM does not define itself)."""

    def requested(self, args: argparse.Namespace) -> bool:
        """Whether the command line asks for this feature at its level (default: always)."""
        return True

    def is_enabled(self, args: argparse.Namespace, device: DeviceInfo) -> bool:
        """On when the optimization level reaches the feature's level and it is requested."""
        level = getattr(args, "optimization_level", DEFAULT_OPTIMIZATION_LEVEL)
        if level < self.level or not self.requested(args):
            return False
        return self.available(device)[0]

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        """``(True, note)`` when usable on ``device``, else ``(False, why)``."""
        return True, ""

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        """Raise FeatureError for incompatible or unavailable requests; may adjust ``args``."""
        level = getattr(args, "optimization_level", DEFAULT_OPTIMIZATION_LEVEL)
        if self.requested(args) and self.flags and self.level > 0:
            ok, why = self.available(device)
            if not ok:
                raise FeatureError(f"{self.flags[0]} is not available on {device.type}: {why}")
            if level < self.level:
                raise FeatureError(
                    f"{self.flags[0]} needs --optimization-level {self.level} or higher "
                    f"(got {level})"
                )

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        """Register this feature's patches on ``pm``."""


FEATURES: list[Feature] = []


def register_feature(feature: Feature) -> Feature:
    """Add a feature instance to the global registry (names are unique)."""
    if any(f.name == feature.name for f in FEATURES):
        raise ValueError(f"feature {feature.name!r} registered twice")
    FEATURES.append(feature)
    return feature


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


def add_arguments(parser: argparse._ActionsContainer) -> argparse._ActionsContainer:
    """Add ``--optimization-level`` and every feature's flags to ``parser`` (e.g. Megatron's)."""
    _load_builtin_features()
    group = parser.add_argument_group("anyspeed")
    group.add_argument(
        "--optimization-level",
        type=_level,
        default=DEFAULT_OPTIMIZATION_LEVEL,
        help="0: device compatibility only; 1: + device-affine kernels; "
        "2: + accelerated features, each enabled by its own flag (default 2)",
    )
    for feature in FEATURES:
        feature.add_arguments(group)
    return parser


def build_parser() -> ArgumentParser:
    """A parser holding only anyspeed's flags; other flags are left to Megatron."""
    parser = ArgumentParser(prog="anyspeed", add_help=False, allow_abbrev=False)
    add_arguments(parser)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse anyspeed's flags out of ``argv`` (unknown flags are ignored, they are Megatron's)."""
    args, _ = build_parser().parse_known_args(list(argv))
    # Flags that features inspect but Megatron owns are read straight from argv.
    args._argv = list(argv)
    return args


def validate(args: argparse.Namespace, device: DeviceInfo) -> None:
    """Run every feature's validation; the first problem raises FeatureError."""
    _load_builtin_features()
    for feature in FEATURES:
        feature.validate(args, device)


def enabled_features(args: argparse.Namespace, device: DeviceInfo) -> list[Feature]:
    """Features that the command line switches on, in registry order."""
    _load_builtin_features()
    return [f for f in FEATURES if f.is_enabled(args, device)]


def flag_value(args: Any, flag: str) -> Any:
    """Value of ``flag``: the parsed attribute when ``args`` has it (Megatron's namespace), else
    ``--x v`` / ``--x=v`` from the argv recorded by :func:`parse_args`; None when absent."""
    attr = flag.lstrip("-").replace("-", "_")
    if hasattr(args, attr):
        return getattr(args, attr)
    argv = getattr(args, "_argv", None) or []
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith(flag + "="):
            return tok.split("=", 1)[1]
    return None


def flag_set(args: Any, flag: str) -> bool:
    """Whether a store-true ``flag`` is on: the parsed attribute, else its presence in argv."""
    attr = flag.lstrip("-").replace("-", "_")
    if hasattr(args, attr):
        return bool(getattr(args, attr))
    argv = getattr(args, "_argv", None) or []
    return any(tok == flag or tok.startswith(flag + "=") for tok in argv)


_loaded = False


def _load_builtin_features() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from anyspeed.features import (  # noqa: F401  (they register on import)
        device_compat,
        gloo_collectives,
        kernels,
        layout_check,
        megatron_lm,
    )
    from anyspeed.features.context_parallel import feature  # noqa: F401
