"""FP8 training settings: Megatron-LM's ``--fp8-*`` flags as one value, and their config fields.

The flags are Megatron's (``--fp8-format``, ``--fp8-recipe``, ``--fp8-margin``,
``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``, ``--no-fp8-wgrad``,
``--first-last-layers-bf16`` with ``--num-layers-at-{start,end}-in-bf16``), and so are the
``TransformerConfig`` fields they set. Without Transformer Engine, the ``fp8`` feature
(:mod:`.feature`) reads them back and runs the layers' GEMMs in FP8 itself.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed")  # the ones anyspeed implements without TE
AMAX_ALGOS = ("most_recent", "max")


@dataclass(frozen=True)
class Fp8Settings:
    """How a run quantizes its linear layers' GEMM operands (per-tensor scales)."""

    format: str = "hybrid"  # e4m3: every operand e4m3; hybrid: gradients e5m2
    recipe: str = "tensorwise"  # tensorwise: scale from this tensor's amax; delayed: its history
    margin: int = 0  # scale = (fp8 max / amax) / 2**margin
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True  # the weight gradient's GEMM in FP8 too
    bf16_start: int = 0  # layers at the start kept in the run's precision
    bf16_end: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Fp8Settings | None:
        """The settings of parsed Megatron-LM flags; None when ``--fp8-format`` is absent."""
        fmt = getattr(args, "fp8", None)
        if not fmt:
            return None
        keep = bool(getattr(args, "first_last_layers_bf16", False))
        return cls(
            format=fmt,
            recipe=getattr(args, "fp8_recipe", None) or "delayed",
            margin=int(getattr(args, "fp8_margin", 0) or 0),
            amax_history_len=int(getattr(args, "fp8_amax_history_len", 1) or 1),
            amax_compute_algo=getattr(args, "fp8_amax_compute_algo", None) or "most_recent",
            wgrad=bool(getattr(args, "fp8_wgrad", True)),
            bf16_start=int(getattr(args, "num_layers_at_start_in_bf16", 1)) if keep else 0,
            bf16_end=int(getattr(args, "num_layers_at_end_in_bf16", 1)) if keep else 0,
        )

    @classmethod
    def from_config(cls, config: Any) -> Fp8Settings | None:
        """The settings a ``TransformerConfig``'s fp8 fields hold (None: fp8 is off)."""
        if not getattr(config, "fp8", None):
            return None
        return cls.from_args(argparse.Namespace(**vars(config)))

    def config_fields(self) -> dict[str, Any]:
        """The ``TransformerConfig`` fields of these settings (Megatron's names)."""
        return dict(
            fp8=self.format,
            fp8_recipe=self.recipe,
            fp8_margin=self.margin,
            fp8_amax_history_len=self.amax_history_len,
            fp8_amax_compute_algo=self.amax_compute_algo,
            fp8_wgrad=self.wgrad,
            first_last_layers_bf16=bool(self.bf16_start or self.bf16_end),
            num_layers_at_start_in_bf16=self.bf16_start,
            num_layers_at_end_in_bf16=self.bf16_end,
        )

    def in_fp8(self, layer_no: int, num_layers: int) -> bool:
        """Whether global layer ``layer_no`` (0-based) of ``num_layers`` runs its GEMMs in FP8."""
        return self.bf16_start <= layer_no < num_layers - self.bf16_end
