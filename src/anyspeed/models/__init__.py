"""Model presets and factories (``--model NAME``)."""

from anyspeed.models.presets import PRESETS, ModelPreset, apply_preset, get_preset

__all__ = ["PRESETS", "ModelPreset", "apply_preset", "get_preset"]
