"""Megatron's own activation recompute, passed through: its flags, checks and config fields.

``--recompute-granularity full|selective``, ``--recompute-method uniform|block``,
``--recompute-num-layers``, ``--recompute-modules`` and ``--distribute-saved-activations`` map
one to one onto Megatron-Core's ``TransformerConfig`` fields; Megatron implements them on every
device. The combinations Megatron would reject inside the ranks are refused here first, as one
line naming the flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's recompute flags (same names, choices and defaults)."""
    g = parser.add_argument_group("activation recompute (Megatron-Core)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument(
        "--recompute-modules",
        nargs="*",
        choices=MODULES,
        default=None,
        help="selective recompute: which submodules (default: core_attn)",
    )
    g.add_argument("--distribute-saved-activations", action="store_true")


@dataclass
class Recompute:
    """Megatron's recompute settings of a run (None / empty: recompute nothing)."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    modules: list[str] = field(default_factory=list)
    distribute_saved_activations: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Recompute:
        """The settings parsed ``args`` ask for (flags absent from ``args`` mean off)."""
        return cls(
            granularity=getattr(args, "recompute_granularity", None),
            method=getattr(args, "recompute_method", None),
            num_layers=getattr(args, "recompute_num_layers", None),
            modules=list(getattr(args, "recompute_modules", None) or []),
            distribute_saved_activations=getattr(args, "distribute_saved_activations", False),
        )

    def check(self, layers_per_stage: int, sequence_parallel: bool = False) -> None:
        """ValueError (one line naming the flag) for what Megatron would refuse in the ranks."""
        g, n = self.granularity, self.num_layers
        if g is None:
            if self.method or n is not None or self.modules or self.distribute_saved_activations:
                raise ValueError(
                    "--recompute-method/-num-layers/-modules and "
                    "--distribute-saved-activations need --recompute-granularity "
                    "full or selective"
                )
            return
        if g == "full":
            if self.method is None or n is None:
                raise ValueError(
                    "--recompute-granularity full needs --recompute-method "
                    "uniform|block and --recompute-num-layers N"
                )
            if not 1 <= n <= layers_per_stage:
                raise ValueError(
                    f"--recompute-num-layers {n} must be between 1 and the layers "
                    f"per pipeline stage ({layers_per_stage})"
                )
            if self.modules:
                raise ValueError(
                    "--recompute-modules is for --recompute-granularity selective; "
                    "remove it with full recompute"
                )
        elif n is not None or self.method is not None:
            raise ValueError(
                "--recompute-method/--recompute-num-layers are for "
                "--recompute-granularity full; remove them with selective"
            )
        if self.distribute_saved_activations and sequence_parallel:
            raise ValueError(
                "--distribute-saved-activations cannot be used with "
                "--sequence-parallel (the activations are already split)"
            )

    def config_fields(self) -> dict[str, Any]:
        """The ``TransformerConfig`` fields (empty when recompute is off)."""
        if self.granularity is None:
            return {}
        fields: dict[str, Any] = dict(
            recompute_granularity=self.granularity,
            recompute_method=self.method,
            recompute_num_layers=self.num_layers,
            distribute_saved_activations=self.distribute_saved_activations,
        )
        if self.granularity == "selective":
            fields["recompute_modules"] = list(self.modules or ["core_attn"])
        return fields
