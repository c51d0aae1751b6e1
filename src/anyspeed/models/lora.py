"""LoRA's shared facts, written once: which layers take adapters, what the adapters are called,
and the record a LoRA checkpoint keeps in its common state.

``training/lora.py`` attaches the adapters and writes the record; ``convert/lora.py`` reads the
record and the adapters back to merge them or export them for PEFT; ``anyspeed posttrain`` lists
the targets in its help. A target layer keeps its weight and gains ``lora_A`` [r, in] and
``lora_B`` [out, r]; the adapted output is ``W x + (alpha / r) * B A x``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Megatron's linear layers that can take adapters (the last component of their module name):
# attention's fused QKV and output, the MLP's (and every expert's), and multi-latent
# attention's projections (MindSpeed-LLM's MLA fuses the two down projections as linear_qkv).
MLA_TARGETS = (
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
)
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", *MLA_TARGETS)
# ``linear_qkv`` on multi-latent attention: the layers MindSpeed-LLM's MLA fuses under that
# name (the query's down- or whole projection and the KV down-projection), one adapter whose
# A they share and whose B rows they split, as one fused layer's adapter would be.
MLA_QKV = ("linear_q_down_proj", "linear_q_proj", "linear_kv_down_proj")
A, B = "lora_A", "lora_B"  # the adapter parameters' names on a target layer
ADAPTER = ".lora_"  # in a parameter's (or checkpoint key's) name: it is an adapter
RECORD = "anyspeed_lora"  # the key of the record in a checkpoint's common state
FLAGS = {"r": "--lora-r", "alpha": "--lora-alpha", "target_modules": "--lora-target-modules"}

_WEIGHT = re.compile(r"decoder\.layers\.\d+\..*\.(" + "|".join(TARGETS) + r")\.weight$")


def target_of(name: str) -> str | None:
    """The target (e.g. ``linear_qkv``) a Megatron weight name belongs to; None for others."""
    mt = _WEIGHT.match(name)
    return mt.group(1) if mt else None


def adapted(layer: str | None, targets: tuple[str, ...] | list[str]) -> bool:
    """Whether ``targets`` adapt the layer named ``layer`` (``linear_qkv`` adapts MLA's fused
    projections as well)."""
    return layer is not None and (
        layer in targets or (layer in MLA_QKV and "linear_qkv" in targets)
    )


def adapter_key(weight_key: str, part: str) -> str:
    """The key of adapter ``part`` (``A`` or ``B``) beside a target layer's weight key."""
    return weight_key.removesuffix("weight") + part


@dataclass(frozen=True)
class LoraRecord:
    """What a LoRA checkpoint records: its rank, alpha and target layers (sorted)."""

    r: int
    alpha: float
    target_modules: tuple[str, ...]

    @classmethod
    def of(cls, r: int, alpha: float, targets: list[str] | tuple[str, ...]) -> LoraRecord:
        return cls(int(r), alpha, tuple(sorted(targets)))

    @property
    def scale(self) -> float:
        """The factor on the adapters' product: alpha / r."""
        return float(self.alpha) / self.r

    def to_common(self) -> dict[str, Any]:
        """The entry of a checkpoint's common state: ``{RECORD: {...}}``."""
        fields = {"r": self.r, "alpha": self.alpha, "target_modules": list(self.target_modules)}
        return {RECORD: fields}

    @classmethod
    def from_common(cls, common: dict[str, Any]) -> LoraRecord | None:
        """The record of a checkpoint's common state; None when it has none (not LoRA)."""
        saved = common.get(RECORD)
        if saved is None:
            return None
        return cls.of(saved["r"], saved["alpha"], saved["target_modules"])

    def mismatch(self, **given: Any) -> str | None:
        """The first of ``given`` (r, alpha, target_modules; None: not given) that differs from
        this record, as "FLAG SAVED, not GIVEN"; None when all agree (8 == 8.0 for alpha)."""
        for field, value in given.items():
            if value is None:
                continue
            saved = getattr(self, field)
            if field == "target_modules":
                saved, value = list(saved), sorted(value)
            if value != saved:
                return f"{FLAGS[field]} {saved}, not {value}"
        return None
