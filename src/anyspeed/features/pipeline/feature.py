"""Level-2 feature ``dualpipev`` (MindSpeed's ``--schedules-method dualpipev``).

Each pipeline rank holds two chunks in a V (rank ``r``: stages ``r`` and ``2PP - 1 - r``) and
runs DeepSeek-V3's DualPipeV order (:mod:`anyspeed.distributed.dualpipev`). Megatron-Core 0.16.1
places a rank's second chunk at stage ``PP + r`` (interleaving); the one patch here moves its
layers to stage ``2PP - 1 - r``, so layer numbers, and with them checkpoints, stay global: a
DualPipeV checkpoint loads at any other layout. That patch belongs to ``chunk-placement``
(level 0, always on, inert without a V) so no process can build a V with Megatron's offsets.
The engine builds the chunks, picks the schedule and finds the loss on pipeline rank 0
(``anyspeed.distributed.pipeline``); this feature owns the flags and their checks.
"""

from __future__ import annotations

import argparse
import functools

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag
from anyspeed.patching import PatchManager

METHODS = ("1f1b", "dualpipev")


def _stage(config, vp_stage, pp_rank) -> int:  # noqa: ANN001 - Megatron's arguments
    """The stage that chunk ``vp_stage`` (None: the only one) of ``pp_rank`` (None: this rank)
    holds: ``2PP - 1 - r`` for a V's second chunk, else Megatron's ``chunk x PP + r``."""
    from megatron.core import parallel_state as ps

    rank = ps.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
    chunk, pp = vp_stage or 0, config.pipeline_model_parallel_size
    if getattr(config, "anyspeed_dualpipev", False) and chunk == 1:
        return 2 * pp - 1 - rank
    return chunk * pp + rank


def _placed_by_anyspeed(answer, v_only: bool = False):
    """A wrapper for one of Megatron's placement functions ``(config, vp_stage, pp_rank)``:
    where anyspeed places the layers (a V, noop slots: ``config.anyspeed_stage_layers``),
    ``answer(config, real layers per stage, this chunk's stage)``; else Megatron's."""

    def wrap(original):
        @functools.wraps(original)
        def placed(config, vp_stage=None, pp_rank=None):
            layers = getattr(config, "anyspeed_stage_layers", None)
            v = getattr(config, "anyspeed_dualpipev", False)
            if not layers or (v and vp_stage is None) or (v_only and not v):
                return original(config, vp_stage, pp_rank)
            return answer(config, layers, _stage(config, vp_stage, pp_rank))

        return placed

    return wrap


# the first layer, the layer count and (a V's) MTP layers, beside the loss, of a chunk
_wrap_offset = _placed_by_anyspeed(lambda config, layers, stage: sum(layers[:stage]))
_wrap_layer_count = _placed_by_anyspeed(lambda config, layers, stage: layers[stage])
_wrap_mtp_layers = _placed_by_anyspeed(
    lambda config, layers, stage: (config.mtp_num_layers or 0) if stage == len(layers) - 1 else 0,
    v_only=True,
)


def refuse_in_megatron_lm(args: argparse.Namespace) -> None:
    """FeatureError when Megatron-LM's own training loop is asked for DualPipeV."""
    if getattr(args, "schedules_method", None) == "dualpipev":
        raise FeatureError(
            "--schedules-method dualpipev runs in `anyspeed pretrain` / `anyspeed posttrain` "
            "(Megatron-LM's training loop builds and schedules its own chunks): run it there, "
            "or leave the flag out"
        )


class DualPipeV(Feature):
    name = "dualpipev"
    level = 2
    description = (
        "DualPipeV pipeline schedule: two chunks per rank in a V, the loss beside the "
        "embedding on rank 0, forwards and backwards of both chunks interleaved"
    )
    flags = ("--schedules-method", "--dualpipev-dw-detach")

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(
            parser,
            "--schedules-method",
            choices=METHODS,
            default=None,
            help="pipeline schedule: dualpipev (two chunks per rank in a V, DeepSeek-V3's) or "
            "Megatron's 1F1B (default; interleaved with "
            "--num-layers-per-virtual-pipeline-stage)",
        )
        add_flag(
            parser,
            "--dualpipev-dw-detach",
            action="store_true",
            help="with dualpipev: where the pipeline would idle, send a backward's input "
            "gradient first and compute its weight gradients later (zero bubble)",
        )

    def requested(self, args: argparse.Namespace) -> bool:
        return getattr(args, "schedules_method", None) == "dualpipev"

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        super().validate(args, device)
        if getattr(args, "dualpipev_dw_detach", False) and not self.requested(args):
            raise FeatureError(
                "--dualpipev-dw-detach needs --schedules-method dualpipev: add it, or leave "
                "the flag out"
            )


class ChunkPlacement(Feature):
    """Level 0, always on: the placement patches are inert unless a model's config carries
    anyspeed's stage layers (a V, noop slots), so a process that applied the adaptor without
    the flags still places them right; the linear patch is inert outside a DualPipeV step that
    defers weight gradients."""

    name = "chunk-placement"
    level = 0
    description = "a chunk's layers where anyspeed's layout puts them (DualPipeV's V, noop slots)"

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        from anyspeed.distributed.dualpipev.weight_grads import wrap_linear

        pm.register_wrap(
            "megatron.core.transformer.transformer_layer.get_transformer_layer_offset",
            _wrap_offset,
            feature=self.name,
            reason="under DualPipeV a rank's second chunk holds stage 2PP-1-r (the V), not "
            "PP+r; noop slots shift the real layers' numbers; a no-op for other configs",
        )
        pm.register_wrap(
            "megatron.core.transformer.transformer_block.get_num_layers_to_build",
            _wrap_layer_count,
            feature=self.name,
            reason="under DualPipeV or with noop slots each stage has its own count of real "
            "layers (uneven first and last stages, a lighter rank 0 in a V)",
        )
        pm.register_wrap(
            "megatron.core.transformer.multi_token_prediction.get_mtp_num_layers_to_build",
            _wrap_mtp_layers,
            feature=self.name,
            reason="under DualPipeV the MTP layers sit with the loss on rank 0's second chunk",
        )
        pm.register_wrap(
            "megatron.core.tensor_parallel.layers."
            "linear_with_grad_accumulation_and_async_allreduce",
            wrap_linear,
            feature=self.name,
            reason="--dualpipev-dw-detach: weight gradients of a backward computed later (W "
            "steps); Megatron's own linear outside such a step",
        )
