"""Models: the one architecture type, its presets, its HF config mapping and the GPT builder.

:class:`ModelConfig` describes an architecture (``--model NAME`` picks a preset);
:mod:`anyspeed.models.gpt` is the only code that builds Megatron objects from it.
"""

from anyspeed.models.config import ModelConfig, padded_vocab_size
from anyspeed.models.hf import HF_ARCHITECTURES, preset_from_hf
from anyspeed.models.presets import PRESETS, apply_preset, get_preset

__all__ = [
    "HF_ARCHITECTURES",
    "PRESETS",
    "ModelConfig",
    "apply_preset",
    "get_preset",
    "padded_vocab_size",
    "preset_from_hf",
]
