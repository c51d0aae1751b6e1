"""The one model record: which architecture a checkpoint holds, written and read here only.

Every anyspeed writer (pretrain, posttrain, convert) stores ``ModelConfig.to_dict()`` under
:data:`MODEL_KEY` in the checkpoint's common state. :func:`model_in_common` reads it back, also
from the key older ``anyspeed pretrain`` checkpoints hold (:data:`LEGACY_MODEL_KEY`) and from
Megatron-LM's stored ``args``, so every checkpoint anyspeed or Megatron-LM wrote converts,
generates and merges LoRA adapters without the architecture given again.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from anyspeed.checkpoint.errors import ModelRecordError
from anyspeed.checkpoint.megatron_lm_args import check_family, megatron_lm_model
from anyspeed.checkpoint.reads import read_common
from anyspeed.models.config import ModelConfig

MODEL_KEY = "anyspeed_model"
LEGACY_MODEL_KEY = "anyspeed_args"  # what anyspeed pretrain wrote before the one record


def model_record(model: ModelConfig) -> dict[str, Any]:
    """The common-state entry that records ``model`` (merge it into the saved state)."""
    return {MODEL_KEY: model.to_dict()}


def model_in_common(
    common: dict[str, Any],
    where: str | os.PathLike[str],
    model_type_hf: str | None = None,
    *,
    as_hf: bool = True,
) -> ModelConfig | None:
    """The model a checkpoint's common state records (``model_type_hf`` picks or checks the
    family); None when it holds no record. An unreadable record is a ModelRecordError, and so
    is, with ``as_hf`` (conversion), an anyspeed model its HF family's traits contradict
    (generate and evaluate run any model)."""
    for key in (MODEL_KEY, LEGACY_MODEL_KEY):
        if key in common:
            try:
                model = ModelConfig.from_dict(common[key])
            except (TypeError, ValueError) as exc:
                raise ModelRecordError(f"{where}: {key}: {exc}") from None
            return check_family(model, where, model_type_hf) if as_hf else model
    if isinstance(common.get("args"), argparse.Namespace):
        return megatron_lm_model(common["args"], where, model_type_hf)
    return None


def read_model(path: str | os.PathLike[str], model_type_hf: str | None = None) -> ModelConfig:
    """The model the checkpoint under ``path`` records; ModelRecordError when it has none."""
    model = model_in_common(read_common(path), path, model_type_hf)
    if model is None:
        raise ModelRecordError(
            f"{path}: no {MODEL_KEY} or Megatron-LM args in the checkpoint (pass --hf-cfg-dir "
            "with the model's config.json)"
        )
    return model


def hf_vocab(load: str | None) -> int | None:
    """The Hugging Face vocabulary of a checkpoint converted from HF (its log-softmax spans
    those rows, not the padding): None otherwise, normalising over every row as Megatron's
    training loss does."""
    from anyspeed.checkpoint.reads import read_common, tracked_dir

    path = tracked_dir(load) if load else None
    common = read_common(path) if path else {}
    return common.get("anyspeed_convert", {}).get("hf_vocab_size") or common.get(HF_VOCAB)


HF_VOCAB = "anyspeed_hf_vocab"  # carried by every checkpoint of a run that started from one


def hf_vocab_record(load: str | None) -> dict[str, int]:
    """The record that keeps a converted start's HF vocabulary in the checkpoints trained
    from it (a resumed RL run without a reference sampled over padding rows without it)."""
    vocab = hf_vocab(load)
    return {HF_VOCAB: vocab} if vocab else {}
