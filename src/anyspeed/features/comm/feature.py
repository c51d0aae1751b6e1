"""Level-1 feature ``gloo-collectives`` (CPU): the distributed optimizer's gloo reduce-scatter /
all-gather of Megatron's grad and param buffers as in-place all-reduces (see
:mod:`.gloo_collectives` for why that is exact and faster)."""

from __future__ import annotations

import argparse

from anyspeed.device import DeviceInfo
from anyspeed.features.base import KernelFeature, add_flag
from anyspeed.features.comm import gloo_collectives as gc
from anyspeed.patching import PatchManager

_TARGET = "megatron.core.distributed.param_and_grad_buffer"


class GlooCollectives(KernelFeature):
    name = "gloo-collectives"
    flags = ("--gloo-all-reduce-collectives",)
    description = (
        "distributed optimizer on CPU: gloo reduce-scatter / all-gather of the grad and "
        "param buffers as in-place all-reduces (about 2x faster under gloo)"
    )

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        super().add_arguments(parser)
        add_flag(
            parser,
            "--no-gloo-all-reduce-collectives",
            action="store_true",
            help="keep gloo's own reduce-scatter / all-gather (for comparison)",
        )

    def requested(self, args: argparse.Namespace) -> bool:
        return not getattr(args, "no_gloo_all_reduce_collectives", False)

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        if device.type != "cpu":
            return False, "only the gloo backend (CPU) needs it; NCCL/XCCL collectives are fast"
        return True, ""

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        for attr, fn in (
            ("dist_reduce_scatter_func", gc.reduce_scatter),
            ("dist_all_gather_func", gc.all_gather),
        ):
            pm.register_wrap(
                f"{_TARGET}.{attr}",
                lambda orig, fn=fn: gc.bind(fn, orig),
                feature=self.name,
                reason="gloo reduce-scatter/all-gather of shard views -> in-place all-reduce",
            )
