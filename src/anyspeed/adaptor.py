"""Apply anyspeed to this process: validate the flags, then install the enabled features' patches.

Importing this module changes nothing. ``apply(args)`` takes a namespace that is already parsed
(Megatron-LM's, ``anyspeed pretrain``'s); ``apply(argv=...)`` parses a command line with the
features' standalone parser. The device layer comes first, then the features the command line
asks for, in registry order. Applying twice is harmless; ``undo()`` removes every patch. A bad
request raises FeatureError (one line) before any process group exists.

Users' scripts get the same through the one line ``import anyspeed.megatron_adaptor`` (the shim
that applies from ``sys.argv``); anyspeed's own modules call :func:`apply`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from anyspeed import features
from anyspeed.device import DeviceInfo, detect
from anyspeed.device.jit import keep_megatron_jit_off
from anyspeed.errors import report
from anyspeed.features import Feature, FeatureError
from anyspeed.features.compat.megatron_lm import MegatronLMArgs
from anyspeed.patching import PatchManager

__all__ = ["AdaptorState", "FeatureError", "apply", "apply_command_line", "state", "undo"]


@dataclass
class AdaptorState:
    """What the adaptor has applied in this process."""

    device: DeviceInfo
    manager: PatchManager = field(default_factory=PatchManager)
    applied: list[Feature] = field(default_factory=list)
    args: argparse.Namespace | None = None


_STATE: AdaptorState | None = None


def state() -> AdaptorState | None:
    """The adaptor's state, or None before the first apply (and after undo)."""
    return _STATE


def apply(
    args: argparse.Namespace | None = None, argv: Sequence[str] | None = None
) -> AdaptorState:
    """Validate and apply the features that ``args`` (or else ``argv``) switch on.

    ``args``: a parsed namespace (gains ``optimization_level`` when it has none). ``argv``:
    parsed with :func:`anyspeed.features.parse_args`; neither means the defaults. Features
    already applied stay as they are. Raises FeatureError (one line) on a bad request.
    """
    global _STATE
    if args is None:
        args = features.parse_args(argv or [])
    elif not hasattr(args, "optimization_level"):
        args.optimization_level = features.DEFAULT_OPTIMIZATION_LEVEL
    if _STATE is None:
        _STATE = AdaptorState(device=detect())
        if not _STATE.device.is_cuda:  # torch.compile'd CUDA fusions: not imported here
            keep_megatron_jit_off()
    st = _STATE
    features.validate(args, st.device)
    new = [f for f in features.enabled_features(args, st.device) if f not in st.applied]
    for feature in new:
        if isinstance(feature, MegatronLMArgs):
            feature.apply_args = apply  # Megatron-LM's validate_args hands its namespace back
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


def apply_command_line(argv: Sequence[str]) -> AdaptorState:
    """:func:`apply` for a command line; a bad request prints ``anyspeed: error: <one line>``
    on stderr and exits with status 2."""
    try:
        from anyspeed.features import registry
        from anyspeed.features.pipeline.feature import refuse_in_megatron_lm

        # A script behind the one line trains with Megatron-LM's own loop: refuse what only
        # anyspeed's engine runs before any other check reports on it.
        refuse_in_megatron_lm(registry.parse_args(argv))
        return apply(argv=argv)
    except FeatureError as exc:
        raise SystemExit(report("anyspeed", exc)) from None
