"""Level-0 feature ``attention-core``: the one owner of the local spec's attention-core class.

Two features bring an attention core for Megatron's ``DotProductAttention`` seam: context
parallelism (needed when CP > 1) and the level-1 flash-attention (SDPA). Exactly one class can sit
there, so this feature decides, in the order it is given: the first enabled candidate's core wins
(context-parallel, then flash-attention); with none enabled Megatron's own class stays.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Protocol

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature
from anyspeed.patching import PatchManager

TARGET = "megatron.core.transformer.dot_product_attention.DotProductAttention"


class CoreProvider(Protocol):
    """A feature that brings an attention core."""

    name: str

    def is_enabled(self, args: argparse.Namespace, device: DeviceInfo) -> bool: ...

    def attention_core(self) -> tuple[type, str]: ...


class AttentionCore(Feature):
    name = "attention-core"
    level = 0
    description = (
        "one owner of the local spec's attention core: context-parallel attention when CP > 1, "
        "else flash-attention's SDPA core when on, else Megatron's DotProductAttention"
    )

    def __init__(self, candidates: Sequence[CoreProvider]) -> None:
        self.candidates = tuple(candidates)  # highest priority first

    def choice(self, args: argparse.Namespace, device: DeviceInfo) -> CoreProvider | None:
        """The feature whose core is used, or None for Megatron's own."""
        return next((f for f in self.candidates if f.is_enabled(args, device)), None)

    def is_enabled(self, args: argparse.Namespace, device: DeviceInfo) -> bool:
        return self.choice(args, device) is not None

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        owner = self.choice(args, device)
        if owner is None:
            return
        core, why = owner.attention_core()
        pm.register_replace(TARGET, core, feature=self.name, reason=f"{owner.name}: {why}")
