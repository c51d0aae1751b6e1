"""Level-2 feature ``context-parallel``: CP attention for Megatron's local spec, any device.

Flags as in MindSpeed: ``--context-parallel-size N`` (Megatron's own flag),
``--context-parallel-algo {megatron_cp_algo, ulysses_cp_algo, hybrid_cp_algo}`` (ring /
Ulysses / both; mapped to Megatron's ``cp_comm_type`` p2p / a2a / a2a+p2p) and
``--ulysses-degree-in-cp U`` for hybrid (Megatron's hierarchical CP sizes [U, CP/U]).
Switched on by a CP size above 1 at level 2.
"""

from __future__ import annotations

import argparse

from anyspeed.device import DeviceInfo
from anyspeed.features import Feature, FeatureError, flag_value, register_feature
from anyspeed.patching import PatchManager

ALGO_TO_COMM = {"megatron_cp_algo": "p2p", "ulysses_cp_algo": "a2a", "hybrid_cp_algo": "a2a+p2p"}


def ulysses_degree(args: argparse.Namespace) -> int | None:
    """``--ulysses-degree-in-cp`` (hybrid's Ulysses group size), None when absent."""
    value = flag_value(args, "--ulysses-degree-in-cp")
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        raise FeatureError(f"--ulysses-degree-in-cp expects an integer (got {value!r})") from None


def cp_size(args: argparse.Namespace) -> int:
    """The requested context-parallel size (1 when absent)."""
    value = flag_value(args, "--context-parallel-size")
    try:
        return int(value) if value is not None else 1
    except (TypeError, ValueError):
        raise FeatureError(f"--context-parallel-size expects an integer (got {value!r})") from None


class ContextParallel(Feature):
    name = "context-parallel"
    level = 2
    flags = ("--context-parallel-size", "--context-parallel-algo", "--ulysses-degree-in-cp",
             "--cp-attention-mask-type", "--use-cp-send-recv-overlap")  # fmt: skip
    description = ("ring / Ulysses / hybrid context-parallel attention in pure PyTorch for the "
                   "local spec (Megatron's own CP needs Transformer Engine)")  # fmt: skip

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        have = getattr(parser, "_option_string_actions", {})
        if "--context-parallel-size" not in have:
            parser.add_argument("--context-parallel-size", type=int, default=1)
        if "--context-parallel-algo" not in have:
            parser.add_argument("--context-parallel-algo", default="megatron_cp_algo",
                                help="megatron_cp_algo (ring), ulysses_cp_algo or "
                                "hybrid_cp_algo (Ulysses inside, ring across)")  # fmt: skip
        if "--cp-attention-mask-type" not in have:
            parser.add_argument("--cp-attention-mask-type", "--attention-mask-type",
                                dest="cp_attention_mask_type", default="causal",
                                help="causal (the only kind anyspeed's CP computes)")  # fmt: skip
        if "--use-cp-send-recv-overlap" not in have:
            parser.add_argument("--use-cp-send-recv-overlap", action="store_true",
                                help="accepted: the ring always overlaps send/receive")  # fmt: skip
        if "--ulysses-degree-in-cp" not in have:
            parser.add_argument("--ulysses-degree-in-cp", type=int, default=None,
                                help="hybrid_cp_algo: ranks per Ulysses group")  # fmt: skip

    def requested(self, args: argparse.Namespace) -> bool:
        return cp_size(args) > 1

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        algo = flag_value(args, "--context-parallel-algo") or "megatron_cp_algo"
        if algo not in ALGO_TO_COMM:
            raise FeatureError(
                f"--context-parallel-algo {algo}: choose megatron_cp_algo (ring), "
                "ulysses_cp_algo or hybrid_cp_algo"
            )
        mask = flag_value(args, "--cp-attention-mask-type") or flag_value(
            args, "--attention-mask-type"
        )
        if mask not in (None, "causal"):
            raise FeatureError(
                f"--cp-attention-mask-type {mask}: anyspeed's context parallelism computes causal "
                "attention only (MindSpeed's 'general' masks are not supported); use causal"
            )
        degree = ulysses_degree(args)
        if algo == "hybrid_cp_algo" and self.requested(args):
            cp = cp_size(args)
            if degree is None or degree < 1 or cp % degree:
                raise FeatureError(
                    f"--context-parallel-algo hybrid_cp_algo needs --ulysses-degree-in-cp "
                    f"dividing --context-parallel-size {cp} (got {degree})"
                )
        elif degree is not None and algo != "hybrid_cp_algo":
            raise FeatureError(
                "--ulysses-degree-in-cp applies to --context-parallel-algo hybrid_cp_algo only"
            )
        super().validate(args, device)  # CP > 1 below level 2 is an error naming the flag

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        import functools

        from anyspeed.features.context_parallel.attention import CPAttention

        comm = ALGO_TO_COMM[flag_value(args, "--context-parallel-algo") or "megatron_cp_algo"]

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
        pm.register_replace(
            "megatron.core.transformer.dot_product_attention.DotProductAttention",
            CPAttention,
            feature=self.name,
            reason="local-spec attention core -> SDPA with ring / Ulysses context parallelism",
        )


CONTEXT_PARALLEL = register_feature(ContextParallel())
