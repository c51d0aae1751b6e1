"""Streaming preprocessing of text corpora into Megatron indexed datasets (``.bin``/``.idx``)."""

from anyspeed.data.errors import DataError, UsageError

__all__ = ["DataError", "UsageError"]
