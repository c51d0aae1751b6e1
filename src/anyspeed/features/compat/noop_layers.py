"""Level-0 feature ``noop-layers``: MindSpeed's ``--noop-layers "i,j"``, empty layer slots that
``--num-layers`` counts, to even out pipeline stages (DeepSeek-V3's 61 layers as 64 slots).

The slots are placement only (:mod:`anyspeed.layout.placement`): the namespace is rewritten to
the real layer count and a tuple of slots, in every entry path, before the layout is derived.
``anyspeed pretrain`` / ``posttrain`` place the real layers through ``chunk-placement``;
Megatron-LM's own loop gets the same placement as Megatron's ``--pipeline-model-parallel-layout``.
Either way the real layers keep their numbers, so a checkpoint does not depend on the slots.
"""

from __future__ import annotations

import argparse

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag
from anyspeed.layout.placement import check_noop_layers, parse_noop_layers


def rewrite_noop_layers(args: argparse.Namespace) -> None:
    """Rewrite ``args`` once: ``--noop-layers`` text to a sorted tuple of slots, and
    ``--num-layers`` (slots) to the real layers; ValueError (one line) on bad input."""
    text = getattr(args, "noop_layers", None)
    if not isinstance(text, str):  # absent, or already rewritten to a tuple
        return
    if getattr(args, "num_layer_list", None):
        raise ValueError(
            "--noop-layers and --num-layer-list both place layers: give one (uneven first "
            "and last stages with noop slots: --decoder-first/last-pipeline-num-layers)"
        )
    noop = parse_noop_layers(text)
    slots = getattr(args, "num_layers", None)
    if noop and slots is not None:
        check_noop_layers(noop, slots - len(noop))
        args.num_layers = slots - len(noop)  # the real layers: the model's own count
    args.noop_layers = noop


class NoopLayers(Feature):
    name = "noop-layers"
    level = 0
    description = "MindSpeed's --noop-layers: empty layer slots that even out pipeline stages"
    flags = ("--noop-layers",)

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(
            parser,
            "--noop-layers",
            type=str,
            default=None,
            help="MindSpeed: 0-based layer slots that compute nothing, counted in --num-layers "
            "(e.g. --num-layers 64 --noop-layers 61,62,63 for 61 real layers on 8 stages)",
        )

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        try:
            rewrite_noop_layers(args)
        except ValueError as exc:
            raise FeatureError(str(exc)) from None
