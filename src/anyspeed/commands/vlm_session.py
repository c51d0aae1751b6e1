"""Load a trained LLaVA (``anyspeed posttrain --stage vlm``) checkpoint for inference: one
process, whatever layout it was trained at (torch_dist reshards on load)."""

from __future__ import annotations

from typing import Any

import torch


def llava_of(ckpt: str) -> Any:
    """The :class:`LlavaConfig` a ``vlm`` checkpoint records (language model included)."""
    from anyspeed.checkpoint.reads import read_common, tracked_dir
    from anyspeed.checkpoint.record import model_in_common
    from anyspeed.models.vision import RECORD, from_record

    path = tracked_dir(ckpt)
    common = read_common(path) if path else {}
    if RECORD not in common:
        raise ValueError(f"{ckpt}: not a checkpoint of anyspeed posttrain --stage vlm")
    return from_record(common[RECORD], model_in_common(common, ckpt, as_hf=False))


def load_llava(ckpt: str) -> tuple[torch.nn.Module, Any]:
    """The checkpoint's LLaVA model (TP1, eval) and config; Megatron's parallel state (one
    rank) must be initialised (:func:`anyspeed.convert.megatron_io.megatron_session`)."""
    from anyspeed.checkpoint.save_load import load_weights
    from anyspeed.models import gpt, multimodal

    cfg = llava_of(ckpt)
    config = gpt.transformer_config(cfg.language, perform_initialization=False)
    model = multimodal.build_llava(cfg, config)
    load_weights(ckpt, [model])
    return model.eval(), cfg
