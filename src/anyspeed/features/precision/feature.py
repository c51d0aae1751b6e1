"""Level-2 feature ``reuse-fp32-param`` (MindSpeed's ``--reuse-fp32-param``).

With ``--bf16`` Megatron's mixed-precision optimizers (``Float16OptimizerWithFloat16Params``
and the distributed optimizer) keep a 4-byte fp32 master next to every 2-byte bf16 weight (or
this rank's shard of it). Here the master is held as the bf16 weight plus a 16-bit residual
(:mod:`anyspeed.features.precision.reuse_fp32`): 2 bytes per parameter less (divided by DP with
the distributed optimizer), the same masters bit for bit, checkpoints in the usual format.
"""

from __future__ import annotations

import argparse
import functools

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag
from anyspeed.patching import PatchManager

_OPT = "megatron.core.optimizer."
TARGETS = (
    _OPT + "optimizer.Float16OptimizerWithFloat16Params.__init__",
    _OPT + "distrib_optimizer.DistributedOptimizer.__init__",
)


def _wrap_init(init):
    from anyspeed.features.precision.reuse_fp32 import install

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if getattr(self, "reuse_fp32_param", None) is None:
            install(self)

    return __init__


class ReuseFP32Param(Feature):
    name = "reuse-fp32-param"
    level = 2
    description = (
        "bf16 training keeps each fp32 master as the bf16 weight + a 16-bit residual: "
        "-2 bytes/param (/DP with the distributed optimizer), bit-exact masters"
    )
    flags = ("--reuse-fp32-param",)

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(
            parser,
            "--reuse-fp32-param",
            action="store_true",
            help="with --bf16: hold fp32 master weights as bf16 weight + 16-bit residual "
            "(saves 2 bytes per parameter, bit-exact)",
        )

    def requested(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "reuse_fp32_param", False))

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        super().validate(args, device)
        if self.requested(args) and not getattr(args, "bf16", False):
            raise FeatureError(
                "--reuse-fp32-param needs --bf16 (the master is the bf16 weight plus a 16-bit "
                "residual): add --bf16 or remove --reuse-fp32-param"
            )

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        for target in TARGETS:
            pm.register_wrap(
                target,
                _wrap_init,
                feature=self.name,
                reason="after Megatron builds the fp32 masters, hold them as bf16 weight + "
                "16-bit residual, rebuilt a chunk at a time for the step and for checkpoints",
            )
