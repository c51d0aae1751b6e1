"""The Feature type every family builds on, its one-line error and its flag helpers."""

from __future__ import annotations

import argparse
from typing import Any

from anyspeed.device import DeviceInfo
from anyspeed.errors import OneLineArgumentParser, UsageError
from anyspeed.patching import PatchManager

OPTIMIZATION_LEVELS = (0, 1, 2)
DEFAULT_OPTIMIZATION_LEVEL = 2


class FeatureError(UsageError):
    """Bad or unavailable feature request; the message is one line naming the flag and the fix."""


class ArgumentParser(OneLineArgumentParser):
    """argparse that raises FeatureError (one line) instead of printing usage and exiting."""

    error_type = FeatureError


def dest(flag: str) -> str:
    """The namespace attribute argparse gives ``flag`` (``--use-flash-attn`` -> use_flash_attn)."""
    return flag.lstrip("-").replace("-", "_")


def level_of(args: argparse.Namespace) -> int:
    """The ``--optimization-level`` of a parsed namespace (the default when it has none)."""
    return getattr(args, "optimization_level", DEFAULT_OPTIMIZATION_LEVEL)


def add_flag(parser: argparse._ActionsContainer, *names: str, **kwargs: Any) -> bool:
    """Add an argument unless the parser already has one of ``names`` (its definition wins, e.g.
    Megatron-LM's own); True when added."""
    have = getattr(parser, "_option_string_actions", {})
    if any(name in have for name in names):
        return False
    parser.add_argument(*names, **kwargs)
    return True


class Feature:
    """Base class. Subclasses set ``name``, ``level``, ``description`` and override hooks."""

    name: str = ""
    level: int = 0
    description: str = ""
    flags: tuple[str, ...] = ()  # the command-line flags this feature owns or inspects

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        """Add this feature's flags (each only when the parser lacks it: see :func:`add_flag`)."""

    def flag_notes(self) -> dict[str, str]:
        """Flag -> what it does here, for ``anyspeed features`` (only where rows need more)."""
        return {}

    def requested(self, args: argparse.Namespace) -> bool:
        """Whether the command line asks for this feature at its level (default: always)."""
        return True

    def is_enabled(self, args: argparse.Namespace, device: DeviceInfo) -> bool:
        """On when the optimization level reaches the feature's level and it is requested."""
        if level_of(args) < self.level or not self.requested(args):
            return False
        return self.available(device)[0]

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        """``(True, note)`` when usable on ``device``, else ``(False, why)``."""
        return True, ""

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        """Raise FeatureError for incompatible or unavailable requests; may adjust ``args``."""
        level = level_of(args)
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


class KernelFeature(Feature):
    """A level-1 feature: on by default at level >= 1; its flag at level 0 is an error."""

    level = 1

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(parser, self.flags[0], action="store_true", help=self.description)

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        level = level_of(args)
        if getattr(args, dest(self.flags[0]), False) and level < self.level:
            raise FeatureError(
                f"{self.flags[0]} is a level-{self.level} feature: use --optimization-level "
                f">= {self.level} (got {level})"
            )
