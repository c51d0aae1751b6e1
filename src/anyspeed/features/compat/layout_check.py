"""Level-0 feature ``layout-check``: refuse an impossible parallel layout before any process
group starts.

Reads the parsed Megatron-LM / MindSpeed flags (Megatron-LM's namespace, ``anyspeed pretrain``'s,
or the standalone parser's) and the torchrun world size, and asks :class:`anyspeed.layout.Layout`
-- the one derivation and validation -- whether they fit; a bad combination is a one-line error.
"""

from __future__ import annotations

import argparse
import os

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError
from anyspeed.layout import Layout


class LayoutCheck(Feature):
    name = "layout-check"
    level = 0
    description = (
        "checks TP/PP/VPP/CP/EP sizes against world size, heads, layers and experts before start-up"
    )
    flags = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size")

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        world = getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE")
        if world is None:
            return  # not launched as a distributed job: nothing to check against
        gqa = getattr(args, "group_query_attention", False)
        try:
            Layout.from_args(args).validate(
                int(world),
                num_layers=getattr(args, "num_layers", None),
                num_attention_heads=getattr(args, "num_attention_heads", None),
                num_query_groups=getattr(args, "num_query_groups", None) if gqa else None,
                seq_length=getattr(args, "seq_length", None),
                num_experts=getattr(args, "num_experts", None),
            )
        except ValueError as exc:
            raise FeatureError(str(exc)) from None
