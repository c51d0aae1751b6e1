"""The one line: ``import anyspeed.megatron_adaptor`` after ``import torch``.

On import it reads ``sys.argv`` (here, in one place), validates the anyspeed flags against the
detected device, and applies the enabled features' patches: the device layer first, then the
features the command line asks for. ``apply(args)`` does the same programmatically. Importing or
applying twice is harmless. A bad request stops the process with a one-line error before any
process group exists.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from anyspeed import features as _features
from anyspeed.device import DeviceInfo, detect
from anyspeed.features import Feature, FeatureError
from anyspeed.patching import PatchManager

__all__ = ["apply", "undo", "state", "FeatureError"]


@dataclass
class AdaptorState:
    """What the adaptor has applied in this process."""

    device: DeviceInfo
    manager: PatchManager = field(default_factory=PatchManager)
    applied: list[Feature] = field(default_factory=list)
    args: argparse.Namespace | None = None


_STATE: AdaptorState | None = None


def state() -> AdaptorState | None:
    """The adaptor's state, or None before the first apply."""
    return _STATE


def apply(
    args: argparse.Namespace | None = None, argv: Sequence[str] | None = None
) -> AdaptorState:
    """Validate and apply the features that ``args`` (or ``argv``) switch on.

    ``args`` may be Megatron-LM's parsed namespace or the result of
    :func:`anyspeed.features.parse_args`. Already-applied features are left as they are.
    Raises FeatureError (one line) on a bad request.
    """
    global _STATE
    if args is None:
        args = _features.parse_args(sys.argv[1:] if argv is None else argv)
    elif not hasattr(args, "optimization_level"):
        args.optimization_level = _features.DEFAULT_OPTIMIZATION_LEVEL
    if _STATE is None:
        _STATE = AdaptorState(device=detect())
    st = _STATE
    _features.validate(args, st.device)
    new = [f for f in _features.enabled_features(args, st.device) if f not in st.applied]
    for feature in new:
        feature.register_patches(st.manager, args, st.device)
    st.manager.apply()
    st.applied.extend(new)
    st.args = args
    return st


def undo() -> None:
    """Remove every patch the adaptor applied (tests use this to compare with and without)."""
    global _STATE
    if _STATE is not None:
        _STATE.manager.clear()
        _STATE = None


def _apply_from_command_line() -> None:
    try:
        apply(argv=sys.argv[1:])
    except FeatureError as exc:
        print(f"anyspeed: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


_apply_from_command_line()
