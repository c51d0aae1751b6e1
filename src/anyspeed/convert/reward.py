"""Reward models (``--stage orm`` checkpoints) to and from transformers'
``*ForSequenceClassification`` with one label: the language model's mapping with the vocabulary
projection replaced by the scalar head (``output_layer.score.weight`` <-> ``score.weight``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from anyspeed.models.families.base import FamilyMapping
from anyspeed.models.reward_head import HEAD_KEY

RECORD = "anyspeed_reward_model"  # in a reward model checkpoint's common state


def is_reward_model(common: dict[str, Any]) -> bool:
    """Whether a checkpoint's common state says it holds a reward head."""
    return RECORD in common


def is_reward_config(cfg: dict[str, Any]) -> bool:
    """Whether an HF ``config.json`` describes a one-label sequence-classification model."""
    archs = cfg.get("architectures") or []
    seq = any(str(a).endswith("ForSequenceClassification") for a in archs)
    return seq and int(cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)) == 1


def reward_mapping(m: FamilyMapping) -> FamilyMapping:
    """``m`` with ``output_layer.weight -> lm_head.weight`` replaced by the head."""
    top = {k: v for k, v in m.top.items() if k != "output_layer.weight"}
    return dataclasses.replace(m, top={**top, HEAD_KEY: "score.weight"})


def reward_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json of the sequence-classification model of causal LM config ``cfg``."""
    arch = [a.replace("ForCausalLM", "ForSequenceClassification") for a in cfg["architectures"]]
    return dict(
        cfg, architectures=arch, num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}
    )
