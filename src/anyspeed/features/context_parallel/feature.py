"""Level-2 feature ``context-parallel``: CP attention for Megatron's local spec, any device.

Flags as in MindSpeed: ``--context-parallel-size N`` (Megatron's own flag),
``--context-parallel-algo {megatron_cp_algo, ulysses_cp_algo, hybrid_cp_algo}`` (ring /
Ulysses / both: :class:`anyspeed.layout.CPAlgo`, whose value is Megatron's ``cp_comm_type``)
and ``--ulysses-degree-in-cp U`` for hybrid (Megatron's hierarchical CP sizes [U, CP/U]).
Switched on by a CP size above 1 at level 2; its attention core is installed by the
``attention-core`` feature (the one owner of that seam).
"""

from __future__ import annotations

import argparse
import functools

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag
from anyspeed.layout import CPAlgo
from anyspeed.patching import PatchManager


def cp_size(args: argparse.Namespace) -> int:
    """The requested context-parallel size (1 when absent)."""
    return int(getattr(args, "context_parallel_size", None) or 1)


def cp_algo(args: argparse.Namespace) -> CPAlgo:
    """The requested CP algorithm (ring when absent); FeatureError (one line) when unknown."""
    try:
        return CPAlgo.parse(getattr(args, "context_parallel_algo", None))
    except ValueError as exc:
        raise FeatureError(str(exc)) from None


class ContextParallel(Feature):
    name = "context-parallel"
    level = 2
    flags = (
        "--context-parallel-size",
        "--context-parallel-algo",
        "--ulysses-degree-in-cp",
        "--cp-attention-mask-type",
        "--use-cp-send-recv-overlap",
    )
    description = (
        "ring / Ulysses / hybrid context-parallel attention in pure PyTorch for the "
        "local spec (Megatron's own CP needs Transformer Engine)"
    )

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(parser, "--context-parallel-size", type=int, default=1)
        add_flag(
            parser,
            "--context-parallel-algo",
            default=CPAlgo.RING.flag,
            help="megatron_cp_algo (ring), ulysses_cp_algo or hybrid_cp_algo (Ulysses "
            "inside, ring across)",
        )
        add_flag(
            parser,
            "--cp-attention-mask-type",
            "--attention-mask-type",
            dest="cp_attention_mask_type",
            default="causal",
            help="causal (the only kind anyspeed's CP computes)",
        )
        add_flag(
            parser,
            "--use-cp-send-recv-overlap",
            action="store_true",
            help="accepted: the ring always overlaps send/receive",
        )
        add_flag(
            parser,
            "--ulysses-degree-in-cp",
            type=int,
            default=None,
            help="hybrid_cp_algo: ranks per Ulysses group",
        )

    def requested(self, args: argparse.Namespace) -> bool:
        return cp_size(args) > 1

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        algo = cp_algo(args)
        mask = getattr(args, "cp_attention_mask_type", None)
        if mask not in (None, "causal"):
            raise FeatureError(
                f"--cp-attention-mask-type {mask}: anyspeed's context parallelism computes causal "
                "attention only (MindSpeed's 'general' masks are not supported); use causal"
            )
        degree = getattr(args, "ulysses_degree_in_cp", None)
        if algo is CPAlgo.HYBRID and self.requested(args):
            cp = cp_size(args)
            if degree is None or degree < 1 or cp % degree:
                raise FeatureError(
                    f"--context-parallel-algo {algo.flag} needs --ulysses-degree-in-cp "
                    f"dividing --context-parallel-size {cp} (got {degree})"
                )
        elif degree is not None and algo is not CPAlgo.HYBRID:
            raise FeatureError(
                f"--ulysses-degree-in-cp applies to --context-parallel-algo {CPAlgo.HYBRID.flag} "
                "only"
            )
        super().validate(args, device)  # CP > 1 below level 2 is an error naming the flag

    def attention_core(self) -> tuple[type, str]:
        """The core class for the attention-core seam, and why."""
        from anyspeed.features.context_parallel.attention import CPAttention

        return CPAttention, "local-spec attention core -> SDPA with ring / Ulysses / hybrid CP"

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        comm = cp_algo(args).value

        def wrap(post_init):
            @functools.wraps(post_init)
            def __post_init__(config):
                post_init(config)
                if config.context_parallel_size > 1:
                    config.cp_comm_type = comm

            return __post_init__

        pm.register_wrap(
            "megatron.core.transformer.transformer_config.TransformerConfig.__post_init__",
            wrap,
            feature=self.name,
            reason="--context-parallel-algo selects Megatron's cp_comm_type (p2p = ring, "
            "a2a = Ulysses, a2a+p2p = hybrid)",
        )
