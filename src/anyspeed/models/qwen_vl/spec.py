"""What a Qwen2-VL / Qwen2.5-VL checkpoint records beside its language model: the HF
``config.json`` (the tower and the special tokens), the image processor's settings and the
tokenizer's directory (checkpoint entry :data:`RECORD`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.qwen_vl.config import TowerConfig, tower_from_hf
from anyspeed.models.qwen_vl.positions import VisionTokens

RECORD = "anyspeed_qwen_vl"
KINDS = ("qwen2_vl", "qwen2_5_vl")


def is_qwen_vl(config: dict[str, Any]) -> bool:
    """Whether an HF config.json describes a Qwen2-VL / Qwen2.5-VL model."""
    return config.get("model_type") in KINDS


def tokens_from_hf(config: dict[str, Any]) -> VisionTokens:
    """The vision-block rule of an HF config (Qwen2.5-VL's video time scale: HF's default 4)."""
    tower = tower_from_hf(config["vision_config"])
    qwen25 = tower.kind == "qwen2_5_vl"
    seconds = config["vision_config"].get("tokens_per_second", 4) if qwen25 else None
    return VisionTokens(
        config["image_token_id"], config["video_token_id"], tower.spatial_merge_size, seconds
    )


@dataclasses.dataclass(frozen=True)
class QwenVLSpec:
    """A Qwen-VL model: its HF config, language model and processor settings."""

    hf_config: dict[str, Any]
    language: ModelConfig
    processor: dict[str, Any]
    tokenizer: str | None = None  # the directory the run's tokenizer came from

    @property
    def tower(self) -> TowerConfig:
        return tower_from_hf(self.hf_config["vision_config"])

    @property
    def tokens(self) -> VisionTokens:
        return tokens_from_hf(self.hf_config)

    def with_language(self, **changes: Any) -> QwenVLSpec:
        return dataclasses.replace(self, language=dataclasses.replace(self.language, **changes))

    def record(self) -> str:
        return record(self.hf_config, self.processor, self.tokenizer)


def record(hf_config: dict[str, Any], processor: dict[str, Any], tokenizer: str | None) -> str:
    """The checkpoint entry (JSON; the language model is recorded as every run's)."""
    return json.dumps({"hf_config": hf_config, "processor": processor, "tokenizer": tokenizer})


def from_record(text: str, language: ModelConfig) -> QwenVLSpec:
    """Inverse of :meth:`QwenVLSpec.record` with the checkpoint's language model."""
    rec = json.loads(text)
    return QwenVLSpec(rec["hf_config"], language, rec.get("processor") or {}, rec.get("tokenizer"))
