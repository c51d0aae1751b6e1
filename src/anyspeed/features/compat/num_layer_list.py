"""Level-0 feature ``num-layer-list``: MindSpeed-LLM's ``--num-layer-list`` (layers per pipeline
stage).

Megatron-Core 0.16.1 sizes the first and last stage freely and splits the rest evenly. A list
whose middle entries are equal becomes Megatron's ``--decoder-first/last-pipeline-num-layers``
(the namespace is rewritten before the layout is derived, in every entry path). A list whose
middle entries differ (``17,20,22,21``: a third of MindSpeed-LLM's recipes) stays: anyspeed
places those layers (``Layout.layer_list`` and the ``chunk-placement`` patch), and Megatron-LM's
own loop gets them as its ``--pipeline-model-parallel-layout``.
"""

from __future__ import annotations

import argparse

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag
from anyspeed.layout import uneven_stages


class NumLayerList(Feature):
    name = "num-layer-list"
    level = 0
    description = "MindSpeed-LLM's --num-layer-list: layers per pipeline stage, any counts"
    flags = ("--num-layer-list",)

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(
            parser,
            "--num-layer-list",
            type=str,
            default=None,
            help="MindSpeed-LLM: layers per pipeline stage, comma-separated",
        )

    def flag_notes(self) -> dict[str, str]:
        return {
            "--num-layer-list A,..,Z": "--decoder-first-pipeline-num-layers A "
            "--decoder-last-pipeline-num-layers Z (middle stages equal), else each stage "
            "placed by anyspeed"
        }

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        text = getattr(args, "num_layer_list", None)
        if not text:
            return
        if getattr(args, "schedules_method", None) == "dualpipev":
            raise FeatureError(
                "--num-layer-list counts layers per rank; under --schedules-method dualpipev "
                "give the V's first and last stage with --decoder-first/last-pipeline-num-layers"
            )
        pp = getattr(args, "pipeline_model_parallel_size", None) or 1
        try:
            stages = uneven_stages(
                pp,
                getattr(args, "decoder_first_pipeline_num_layers", None),
                getattr(args, "decoder_last_pipeline_num_layers", None),
                text,
            )
        except ValueError as exc:
            raise FeatureError(str(exc)) from None
        counts = [int(x) for x in text.split(",")]
        layers = getattr(args, "num_layers", None)
        if layers is not None and sum(counts) != layers:
            raise FeatureError(
                f"--num-layer-list {text} adds up to {sum(counts)} layers; --num-layers is {layers}"
            )
        if "layer_list" in stages:  # unequal middle stages: the layout places them
            if getattr(args, "num_layers_per_virtual_pipeline_stage", None) or getattr(
                args, "virtual_pipeline_model_parallel_size", None
            ):
                raise FeatureError(
                    f"--num-layer-list {text} gives each pipeline stage its layers: drop "
                    "--num-layers-per-virtual-pipeline-stage (VPP)"
                )
            return
        args.decoder_first_pipeline_num_layers = stages.get("first_stage_layers")
        args.decoder_last_pipeline_num_layers = stages.get("last_stage_layers")
        args.num_layer_list = None  # rewritten: later checks read Megatron's flags only
