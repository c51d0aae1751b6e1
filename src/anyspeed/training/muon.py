"""``--optimizer muon`` / ``dist_muon``: Megatron-Core's own Muon (``TensorParallelMuon`` on
the 2-D weights, Adam on the rest) with Megatron-LM's flag names, on every device.

Megatron's Muon imports ``emerging_optimizers``; where that package does not import,
:mod:`anyspeed.features.compat.muon_fallback` stands in for it. ``dist_muon`` is Megatron's
layer-wise distributed form (each data-parallel rank updates whole layers, then broadcasts);
in Megatron-Core 0.16.1 its state does not save in fp32 (the layer-wise wrapper reads the bf16
wrapper's layout) and in bf16 its first loss already differs from ``muon``'s, so anyspeed runs it
in fp32 without checkpoints, where it equals ``muon`` (tests/training/test_muon.py).
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
    mcore = "Megatron-Core's Muon refuses it"
    refused = {  # flag: (set, why, what else to do)
        "--fp16": (args.fp16, mcore, ""),
        "--use-distributed-optimizer": (
            getattr(args, "use_distributed_optimizer", False),
            mcore,
            "; --optimizer dist_muon is Muon's distributed form",
        ),
        "--overlap-grad-reduce": (getattr(args, "overlap_grad_reduce", False), mcore, ""),
        "--overlap-param-gather": (getattr(args, "overlap_param_gather", False), mcore, ""),
    }
    if args.optimizer == "dist_muon":  # Megatron-Core 0.16.1's layer-wise optimizer
        layer_wise = "Megatron-Core 0.16.1's layer-wise Muon"
        refused["--bf16"] = (
            args.bf16,
            f"{layer_wise}'s first loss differs from --optimizer muon's",
            ", or use --optimizer muon",
        )
        refused["--save"] = (
            bool(getattr(args, "save", None)),
            f"{layer_wise} cannot save fp32 state",
            ", or use --optimizer muon",
        )
    for flag, (on, why, hint) in refused.items():
        if on:
            raise UsageError(
                f"--optimizer {args.optimizer} with {flag} is not supported ({why}); "
                f"drop {flag}{hint}"
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
