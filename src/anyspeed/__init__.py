"""anyspeed: MindSpeed-style acceleration that makes Megatron-Core train on any PyTorch device.

``import anyspeed.megatron_adaptor`` (after ``import torch``) adapts Megatron-LM's own scripts;
``anyspeed <command>`` / ``python -m anyspeed <command>`` runs anyspeed's LLM workflow.
Importing this package has no side effects.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("anyspeed")
except PackageNotFoundError:  # a source tree without installed metadata
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
