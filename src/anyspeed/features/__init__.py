"""Features: named units of behaviour with a level, CLI flags, validation and patches.

Optimization levels follow MindSpeed: 0 = device compatibility only; 1 = + device-affine kernels
(on by default where available); 2 = + accelerated features, each switched on by its own flag.
A feature states on which devices it is available and why not elsewhere; asking for an
unavailable one is a one-line error naming the flag, raised before any process group starts.

**Knob or feature?** A Megatron config knob that Megatron implements on every device is *passed
through*: an argument mapped to its config field in one place, the model builder
(``anyspeed.models``), not here. Behaviour Megatron lacks or gets wrong off CUDA is a *feature*:
a :class:`Feature` with a level, flags, validation and accountable patches. Features patch
``megatron.core`` seams only; only the ``megatron-lm-*`` features touch ``megatron.training``.
Features never import the training, model, conversion or data layers, nor the adaptor: the
adaptor (:mod:`anyspeed.adaptor`) applies them.

**Layout.** One folder per family -- ``compat/`` (level 0), ``ops/`` (level-1 kernels),
``comm/`` (collectives), ``context_parallel/`` -- each with small wiring modules (``feature.py``)
next to the algorithm and communication modules they install. :mod:`.registry` is the explicit,
ordered list; :mod:`.flags` declares and parses the flags; :mod:`.attention_core` is the one
owner of the attention-core seam; :mod:`.report` is what ``anyspeed features`` prints.
"""

from __future__ import annotations

from anyspeed.features import registry
from anyspeed.features.base import (
    DEFAULT_OPTIMIZATION_LEVEL,
    OPTIMIZATION_LEVELS,
    ArgumentParser,
    Feature,
    FeatureError,
    KernelFeature,
    add_flag,
)
from anyspeed.features.flags import MEGATRON_FLAGS
from anyspeed.features.registry import (
    add_arguments,
    build_parser,
    enabled_features,
    features,
    parse_args,
    validate,
)

__all__ = [
    "DEFAULT_OPTIMIZATION_LEVEL",
    "OPTIMIZATION_LEVELS",
    "MEGATRON_FLAGS",
    "ArgumentParser",
    "Feature",
    "FeatureError",
    "KernelFeature",
    "add_flag",
    "add_arguments",
    "build_parser",
    "parse_args",
    "validate",
    "enabled_features",
    "features",
    "registry",
]
