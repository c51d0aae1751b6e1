"""Training settings (batch, optimizer, precision, seed) and their one mapping from flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from anyspeed.features.fp8.settings import Fp8Settings
from anyspeed.models.recompute import Recompute
from anyspeed.training.muon import MuonConfig


@dataclass
class TrainConfig:
    """What a training step needs besides the model and the layout."""

    seq_length: int = 32
    micro_batch_size: int = 2
    global_batch_size: int = 8
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    data_seed: int = 4321  # synthetic batches only
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None  # fp16: None = dynamic loss scaling
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    optimizer: str = "adam"  # "adam" | "sgd" | "muon" | "dist_muon"
    muon: MuonConfig = field(default_factory=MuonConfig)
    # Reduce gradients in fp32 (--accumulate-allreduce-grads-in-fp32). Default: Megatron-LM's,
    # i.e. in the parameters' dtype, so bf16 training reduces bf16 gradients.
    grad_reduce_in_fp32: bool = False
    # Megatron's activation recompute (a Recompute or its fields as a dict)
    recompute: Recompute = field(default_factory=Recompute)
    # --fp8-format and its flags (None: the GEMMs run in the run's precision)
    fp8: Fp8Settings | None = None

    def __post_init__(self) -> None:
        if isinstance(self.recompute, dict):
            self.recompute = Recompute(**self.recompute)
        if isinstance(self.fp8, dict):
            self.fp8 = Fp8Settings(**self.fp8)

    def config_fields(self) -> dict:
        """The ``TransformerConfig`` fields these settings set (recompute, fp8)."""
        fp8 = self.fp8.config_fields() if self.fp8 else {}
        return {**self.recompute.config_fields(), **fp8}

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    def check(self, dp: int) -> None:
        """ValueError (one line) when the global batch does not split over ``dp`` ranks."""
        if self.global_batch_size % (self.micro_batch_size * dp):
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by "
                f"--micro-batch-size {self.micro_batch_size} x data-parallel size {dp}"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        """The settings checked pretraining ``args`` describe (Megatron-LM flag names)."""
        names = (
            "seq_length",
            "micro_batch_size",
            "global_batch_size",
            "lr",
            "min_lr",
            "weight_decay",
            "clip_grad",
            "seed",
            "bf16",
            "fp16",
            "loss_scale",
            "initial_loss_scale",
            "min_loss_scale",
            "loss_scale_window",
            "hysteresis",
            "adam_beta1",
            "adam_beta2",
            "adam_eps",
            "optimizer",
        )
        values = {n: getattr(args, n) for n in names}
        return cls(
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            muon=MuonConfig.from_args(args) if hasattr(args, "muon_momentum") else MuonConfig(),
            recompute=Recompute.from_args(args),
            fp8=Fp8Settings.from_args(args),
            **values,
        )
