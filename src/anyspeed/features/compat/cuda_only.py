"""Level-0 feature ``cuda-only-options``: Megatron options that need CUDA-only libraries are
refused off CUDA with a one-line error naming the flag, before any process group starts."""

from __future__ import annotations

import argparse
import importlib.util

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError


class CudaOnlyOptions(Feature):
    name = "cuda-only-options"
    level = 0
    description = "refuses Megatron options that need CUDA-only libraries when not on CUDA"
    flags = ("--transformer-impl", "--enable-cuda-graph", "--tp-comm-overlap")

    def is_enabled(self, args: argparse.Namespace, device: DeviceInfo) -> bool:
        return not device.is_cuda

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        if device.is_cuda:
            return
        on = f"this device is {device.type}"
        impl = getattr(args, "transformer_impl", None)
        if impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
            raise FeatureError(
                f"--transformer-impl transformer_engine needs NVIDIA Transformer Engine; {on}: "
                "use --transformer-impl local"
            )
        graph_impl = getattr(args, "cuda_graph_impl", None)
        if getattr(args, "enable_cuda_graph", False) or graph_impl not in (None, "none"):
            raise FeatureError(f"--enable-cuda-graph/--cuda-graph-impl need CUDA; {on}: remove it")
        if getattr(args, "tp_comm_overlap", False):
            raise FeatureError(
                f"--tp-comm-overlap needs CUDA with Transformer Engine userbuffers; {on}: remove it"
            )
