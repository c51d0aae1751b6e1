"""``--optimizer muon`` / ``dist_muon``: Megatron-Core's own Muon (``TensorParallelMuon`` on
the 2-D weights, Adam on the rest) with Megatron-LM's flag names, on every device.

Megatron's Muon imports ``emerging_optimizers``; where that package does not import,
:mod:`anyspeed.features.compat.muon_fallback` stands in for it. ``dist_muon`` is Megatron's
layer-wise distributed form (each data-parallel rank updates whole layers, then broadcasts).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

MUON = ("muon", "dist_muon")


@dataclass(frozen=True)
class MuonConfig:
    """Megatron's Muon settings (``OptimizerConfig.muon_*``)."""

    momentum: float = 0.9
    split_qkv: bool = True
    use_nesterov: bool = False
    scale_mode: str = "spectral"
    fp32_matmul_prec: str = "medium"
    num_ns_steps: int = 5
    tp_mode: str = "blockwise"
    extra_scale_factor: float = 1.0
    coefficient_type: str = "quintic"  # anyspeed's: Megatron 0.16.1 always uses "quintic"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MuonConfig:
        return cls(**{f: getattr(args, "muon_" + f) for f in cls.__dataclass_fields__})

    def fields(self) -> dict[str, Any]:
        """As ``OptimizerConfig`` keywords."""
        names = [f for f in self.__dataclass_fields__ if f != "coefficient_type"]
        return {"muon_" + f: getattr(self, f) for f in names}


def add_arguments(g: Any) -> None:
    """Megatron-LM's Muon flags (its names and defaults)."""
    g.add_argument("--muon-momentum", type=float, default=0.9)
    g.add_argument("--muon-no-split-qkv", action="store_false", dest="muon_split_qkv", default=True)
    g.add_argument("--muon-use-nesterov", action="store_true")
    g.add_argument(
        "--muon-scale-mode",
        default="spectral",
        choices=("spectral", "unit_rms_norm", "shape_scaling"),
    )
    g.add_argument("--muon-fp32-matmul-prec", default="medium", choices=("low", "medium", "high"))
    g.add_argument("--muon-num-ns-steps", type=int, default=5)
    g.add_argument(
        "--muon-tp-mode", default="blockwise", choices=("blockwise", "duplicated", "distributed")
    )
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0)
    g.add_argument(
        "--muon-coefficient-type",
        default="quintic",
        choices=("quintic", "simple", "polar_express", "aol"),
        help="Newton-Schulz coefficients (simple: torch.optim.Muon's; polar_express needs a "
        "multiple of 8 steps, aol of 4)",
    )


def check(args: argparse.Namespace) -> None:
    """UsageError (one line) for what Megatron's Muon does not support."""
    from anyspeed.errors import UsageError

    if args.optimizer not in MUON:
        return
    sets = {"polar_express": 8, "aol": 4}.get(args.muon_coefficient_type, 1)
    if args.muon_num_ns_steps % sets:
        raise UsageError(
            f"--muon-coefficient-type {args.muon_coefficient_type} needs --muon-num-ns-steps "
            f"a multiple of {sets}, not {args.muon_num_ns_steps}"
        )
    refused = {
        "--fp16": args.fp16,
        "--use-distributed-optimizer": getattr(args, "use_distributed_optimizer", False),
        "--overlap-grad-reduce": getattr(args, "overlap_grad_reduce", False),
        "--overlap-param-gather": getattr(args, "overlap_param_gather", False),
    }
    for flag, on in refused.items():
        if on:
            hint = (
                "; --optimizer dist_muon is Muon's distributed form"
                if flag == "--use-distributed-optimizer"
                else ""
            )
            raise UsageError(
                f"--optimizer {args.optimizer} with {flag} is not supported by Megatron-Core's "
                f"Muon; drop {flag}{hint}"
            )


def build(opt_config: Any, model: list[Any], optimizer: str, muon: MuonConfig) -> Any:
    """Megatron's Muon over the DDP chunks (Adam for the vectors and embeddings), its
    Newton-Schulz coefficients ``muon.coefficient_type``."""
    import functools

    from anyspeed.features.compat import muon_fallback

    muon_fallback.install()
    from megatron.core.optimizer import muon as mcore_muon

    made = mcore_muon.TensorParallelMuon
    mcore_muon.TensorParallelMuon = functools.partial(made, coefficient_type=muon.coefficient_type)
    try:
        return mcore_muon.get_megatron_muon_optimizer(
            opt_config, model, layer_wise_distributed_optimizer=optimizer == "dist_muon"
        )
    finally:
        mcore_muon.TensorParallelMuon = made
