"""Level-0 feature ``mtp-compat``: multi-token prediction (``--mtp-num-layers``) in every pass.

Megatron-Core 0.16.1 runs the MTP layers in every forward of a model built with them and then
reads the labels to roll them (``labels.clone()``), so a forward without labels (generation,
evaluation logits, the log-prob passes of post-training) fails with an AttributeError. Without
labels there is no MTP loss to add: the MTP layers are skipped and the main head's output is
returned, as DeepSeek-V3's inference does. And at PP > 1 the last stage's
``sharded_state_dict()`` needs the data-parallel groups in its metadata (given here when absent).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature
from anyspeed.patching import PatchManager


def skip_without_labels(previous: Any) -> Any:
    """``GPTModel._postprocess`` that leaves the MTP layers out of a forward without labels."""

    @functools.wraps(previous)
    def _postprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = self.config
        if kwargs.get("labels") is not None or not config.mtp_num_layers:
            return previous(self, *args, **kwargs)
        kwargs["mtp_in_postprocess"] = False
        saved, config.mtp_num_layers = config.mtp_num_layers, None
        try:
            return previous(self, *args, **kwargs)
        finally:
            config.mtp_num_layers = saved

    return _postprocess


def metadata_with_groups(previous: Any) -> Any:
    """``GPTModel.sharded_state_dict`` given the data-parallel groups its MTP branch reads: a
    pipeline stage with MTP layers but no embedding ties its embedding copy through
    ``metadata["dp_cp_group"]``, which a call without metadata (Megatron's default) lacks."""

    @functools.wraps(previous)
    def sharded_state_dict(
        self: Any, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> Any:
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        if getattr(self, "mtp_process", False):
            metadata = ensure_metadata_has_dp_cp_group(metadata)
        return previous(self, prefix, sharded_offsets, metadata)

    return sharded_state_dict


class MTPCompat(Feature):
    name = "mtp-compat"
    level = 0
    description = "multi-token prediction layers skipped in forwards without labels"

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        pm.register_wrap(
            "megatron.core.models.gpt.gpt_model.GPTModel._postprocess",
            skip_without_labels,
            feature=self.name,
            reason="--mtp-num-layers: Megatron rolls the labels of every forward for the MTP "
            "loss; a forward without labels (generation, log-probs) failed on None.clone()",
        )
        pm.register_wrap(
            "megatron.core.models.gpt.gpt_model.GPTModel.sharded_state_dict",
            metadata_with_groups,
            feature=self.name,
            reason="--mtp-num-layers at PP > 1: the last stage's sharded_state_dict() without "
            "metadata failed on metadata['dp_cp_group'] (its MTP embedding tie reads it)",
        )
