"""The explicit, ordered list of features; validation and patches run in this order.

Adding a feature is one line in :func:`build` (nothing registers itself on import). Order:
level 0 (device compatibility first, then checks and Megatron-LM hooks), level 1 kernels, level
2 features, and last the seams that choose between features (``attention-core``).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

from anyspeed.device import DeviceInfo
from anyspeed.features import flags
from anyspeed.features.attention_core import AttentionCore
from anyspeed.features.base import ArgumentParser, Feature
from anyspeed.features.comm.feature import GlooCollectives
from anyspeed.features.compat.accepted_flags import AcceptedFlags
from anyspeed.features.compat.cuda_only import CudaOnlyOptions
from anyspeed.features.compat.delta_net import DeltaNetCompat
from anyspeed.features.compat.device_compat import DeviceCompat, MegatronCoreCompat
from anyspeed.features.compat.dsa_flags import MindSpeedDSAFlags
from anyspeed.features.compat.fsdp import FSDPCompat
from anyspeed.features.compat.gemma_flags import MindSpeedGemmaFlags
from anyspeed.features.compat.layout_check import LayoutCheck
from anyspeed.features.compat.megatron_lm import MegatronLMArgs, MegatronLMCompat
from anyspeed.features.compat.mtp import MTPCompat
from anyspeed.features.compat.next_flags import MindSpeedNextFlags
from anyspeed.features.compat.noop_layers import NoopLayers
from anyspeed.features.compat.num_layer_list import NumLayerList
from anyspeed.features.compat.rope_scaling_flags import MindSpeedRopeFlags
from anyspeed.features.compat.safe_loading import MegatronLMSafeLoading, SafeLoading
from anyspeed.features.compat.vision import VisionCompat
from anyspeed.features.compat.window_mask import WindowPaddingMask
from anyspeed.features.context_parallel.feature import ContextParallel
from anyspeed.features.fp8.feature import Fp8
from anyspeed.features.inference.feature import NoGradFastPath
from anyspeed.features.memory.feature import (
    RecomputeActivation,
    RecomputeCompat,
    RecomputeNorm,
    SwapAttention,
    SwapOptimizer,
)
from anyspeed.features.memory.o2 import O2Optimizer
from anyspeed.features.moe.feature import MoECompat, MoEGroupedGemm
from anyspeed.features.moe.mindspeed_flags import MindSpeedMoEFlags
from anyspeed.features.ops.feature import (
    FlashAttention,
    FusedCrossEntropy,
    FusedNorm,
    FusedRoPE,
    FusedSwiGLU,
)
from anyspeed.features.pipeline.feature import ChunkPlacement, DualPipeV
from anyspeed.features.precision.feature import ReuseFP32Param


def build() -> list[Feature]:
    """A fresh instance of every feature, in order."""
    flash, cp = FlashAttention(), ContextParallel()
    kernels = [flash, FusedSwiGLU(), FusedRoPE(), FusedCrossEntropy(), FusedNorm()]
    return [
        DeviceCompat(),
        MegatronCoreCompat(),
        WindowPaddingMask(),
        CudaOnlyOptions(),
        NoopLayers(),  # rewrites --num-layers to the real layers (before the layout check)
        NumLayerList(),  # rewrites the namespace the layout check reads
        MindSpeedRopeFlags(),
        MindSpeedDSAFlags(),
        MindSpeedNextFlags(),
        MindSpeedGemmaFlags(),
        LayoutCheck(),
        ChunkPlacement(),
        AcceptedFlags(kernels=kernels),
        MegatronLMArgs(add_flags=add_arguments),
        MegatronLMCompat(),
        SafeLoading(),
        MegatronLMSafeLoading(),
        MindSpeedMoEFlags(),
        MoECompat(),
        MoEGroupedGemm(),
        MTPCompat(),
        FSDPCompat(),
        DeltaNetCompat(),
        VisionCompat(),
        RecomputeCompat(),
        O2Optimizer(),
        *kernels,
        Fp8(),
        GlooCollectives(),
        NoGradFastPath(),
        ReuseFP32Param(),
        DualPipeV(),
        cp,
        RecomputeActivation(),
        RecomputeNorm(),
        SwapAttention(),
        SwapOptimizer(),
        AttentionCore(candidates=[cp, flash]),
    ]


@functools.cache
def features() -> tuple[Feature, ...]:
    """The process's features (built once, so the adaptor can tell which are applied)."""
    found = build()
    names = [f.name for f in found]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"feature names must be unique: {dupes}")
    return tuple(found)


def get(name: str) -> Feature:
    """The feature called ``name``; KeyError when there is none."""
    for feature in features():
        if feature.name == name:
            return feature
    raise KeyError(name)


def validate(args: argparse.Namespace, device: DeviceInfo) -> None:
    """Run every feature's validation; the first problem raises FeatureError."""
    for feature in features():
        feature.validate(args, device)


def enabled_features(args: argparse.Namespace, device: DeviceInfo) -> list[Feature]:
    """Features that the command line switches on, in registry order."""
    return [f for f in features() if f.is_enabled(args, device)]


def add_arguments(parser: argparse._ActionsContainer) -> argparse._ActionsContainer:
    """``--optimization-level`` and every feature's own flags, added to ``parser``."""
    return flags.add_arguments(parser, features())


def build_parser() -> ArgumentParser:
    """The standalone parser of the features' flags (:func:`.flags.build_parser`)."""
    return flags.build_parser(features())


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The flags anyspeed reads out of ``argv`` (other flags are Megatron's: ignored)."""
    return flags.parse_args(argv, features())
