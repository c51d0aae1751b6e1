"""Level-0 feature: refuse an impossible parallel layout before any process group starts.

Reads Megatron-LM's own flags (from its parsed namespace, or from the command line when the
adaptor is imported) and the torchrun world size; a bad combination is a one-line error.
"""

from __future__ import annotations

import argparse
import os

from anyspeed.device import DeviceInfo
from anyspeed.features import Feature, FeatureError, flag_set, flag_value, register_feature
from anyspeed.layout import check_layout


def _int(args: argparse.Namespace, flag: str) -> int | None:
    value = flag_value(args, flag)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise FeatureError(f"{flag} expects an integer (got {value!r})") from None


class LayoutCheck(Feature):
    name = "layout-check"
    level = 0
    description = "checks TP/PP/VPP sizes against world size, heads and layers before start-up"
    flags = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size")

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        world = getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE")
        if world is None:
            return  # not launched as a distributed job: nothing to check against
        tp = _int(args, "--tensor-model-parallel-size") or 1
        pp = _int(args, "--pipeline-model-parallel-size") or 1
        layers = _int(args, "--num-layers")
        per_vstage = _int(args, "--num-layers-per-virtual-pipeline-stage")
        vpp = None
        if per_vstage and layers:
            if layers % (pp * per_vstage):
                raise FeatureError(
                    f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size "
                    f"{pp} x --num-layers-per-virtual-pipeline-stage {per_vstage}"
                )
            vpp = layers // pp // per_vstage
        groups = (
            _int(args, "--num-query-groups") if flag_set(args, "--group-query-attention") else None
        )
        cp = _int(args, "--context-parallel-size") or 1
        algo = flag_value(args, "--context-parallel-algo") or "megatron_cp_algo"
        try:
            check_layout(
                world_size=int(world),
                tp=tp,
                pp=pp,
                cp=cp,
                cp_algo={"ulysses_cp_algo": "a2a", "hybrid_cp_algo": "a2a+p2p"}.get(algo, "p2p"),
                ulysses_degree=_int(args, "--ulysses-degree-in-cp"),
                seq_length=_int(args, "--seq-length"),
                vpp=vpp,
                num_layers=layers,
                num_attention_heads=_int(args, "--num-attention-heads"),
                num_query_groups=groups,
                sequence_parallel=flag_set(args, "--sequence-parallel"),
            )
        except ValueError as exc:
            raise FeatureError(str(exc)) from None


LAYOUT_CHECK = register_feature(LayoutCheck())
