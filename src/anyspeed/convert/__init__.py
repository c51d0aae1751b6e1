"""HF <-> Megatron checkpoint conversion (``anyspeed convert``).

One declarative mapping per family (:mod:`anyspeed.models.families`), one shared tensor engine
(:mod:`.engine`), readers/writers for HF safetensors (:mod:`.hf_io`) and Megatron's torch_dist
and legacy layouts (:mod:`.megatron_io`); where a checkpoint is, its format and model record:
:mod:`anyspeed.checkpoint`.
"""

from anyspeed.convert.api import is_hf_dir
from anyspeed.convert.errors import ConvertError
from anyspeed.convert.to_hf import megatron_to_hf
from anyspeed.convert.to_megatron import hf_to_megatron
from anyspeed.convert.verify import verify

__all__ = [
    "ConvertError",
    "hf_to_megatron",
    "is_hf_dir",
    "megatron_to_hf",
    "verify",
]
