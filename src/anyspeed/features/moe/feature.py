"""Level-0 MoE features: Megatron-Core's MoE layers without Transformer Engine, on every device.

* ``moe-compat``: repairs Megatron-Core 0.16.1's MoE path off CUDA and without TE: the router's
  gating matmul names a TE function only defined when TE imports; the alltoall dispatcher's
  split sizes reach ``all_to_all_single`` as tensors; ``jit_fuser`` is ``torch.compile``.
* ``moe-grouped-gemm``: ``--moe-grouped-gemm`` experts (``GroupedMLP``) through PyTorch's
  grouped matmul instead of the CUDA-only ``grouped_gemm`` package.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature, FeatureError, add_flag
from anyspeed.patching import PatchManager

_MOE = "megatron.core.transformer.moe."


def unfused(fn: Any) -> Any:
    """Stands in for ``jit_fuser``: the function runs eagerly. (Not Megatron's own no-op
    decorator: undoing a patch rebinds every copy of the installed object.)"""
    return fn


class MoECompat(Feature):
    name = "moe-compat"
    level = 0
    description = (
        "Megatron-Core's MoE layers, dispatchers and router off CUDA and without TE; "
        "MindSpeed's --moe-tp-extend-ep"
    )
    flags = ("--moe-tp-extend-ep",)

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        add_flag(
            parser,
            "--moe-tp-extend-ep",
            action="store_true",
            help="MindSpeed: experts are split over TP x EP ranks "
            "(= --expert-tensor-parallel-size 1)",
        )

    def flag_notes(self) -> dict[str, str]:
        return {
            "--moe-token-dispatcher-type alltoall_seq": "MindSpeed's name: runs as alltoall",
            "--moe-token-dispatcher-type flex": "DeepEP/HybridEP: CUDA only, refused elsewhere",
        }

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        kind = getattr(args, "moe_token_dispatcher_type", None)
        if kind == "flex" and not device.is_cuda:
            raise FeatureError(
                f"--moe-token-dispatcher-type flex needs DeepEP or HybridEP on CUDA; this device "
                f"is {device.type}: use alltoall or allgather"
            )

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        from megatron.core.transformer.moe import moe_utils

        if not device.is_cuda:
            from anyspeed.features.moe.dispatch import splits_to_host

            pm.register_replace(
                _MOE + "moe_utils.maybe_move_tensor_to_cpu",
                splits_to_host,
                feature=self.name,
                reason="the alltoall dispatcher's split sizes become host numpy arrays only "
                "from CUDA; elsewhere they stay tensors that all_to_all_single refuses",
            )

            pm.register_replace(
                "megatron.core.jit.jit_fuser",
                unfused,
                feature=self.name,
                reason="GroupedMLP wraps its activation in jit_fuser (torch.compile) when built; "
                "inductor off CUDA needs a C++ toolchain and real CUDA device properties",
            )
            from megatron.core.transformer.moe.router import TopKRouter

            compiled = TopKRouter.__dict__["_apply_expert_bias"]
            eager = getattr(compiled, "_torchdynamo_orig_callable", None)
            if eager is not None:  # decorated with jit_fuser when the module was imported
                pm.register_replace(
                    _MOE + "router.TopKRouter._apply_expert_bias",
                    eager,
                    feature=self.name,
                    reason="--moe-router-enable-expert-bias: the bias update is torch.compile'd "
                    "at import; inductor fails off CUDA (it reads CUDA device properties)",
                )
        from anyspeed.features.moe.expert_bias import scale_after

        pm.register_wrap(
            "megatron.core.transformer.mlp.MLP.forward",
            scale_after,
            feature=self.name,
            reason="experts with biases (GPT-OSS): the probability-scaled bias is added in place "
            "on an autograd view, which autograd refuses; added out of place",
        )
        from anyspeed.features.moe.expert_grads import expert_reduction

        for cls in ("ColumnParallelLinear", "RowParallelLinear"):
            pm.register_wrap(
                f"megatron.core.tensor_parallel.layers.{cls}.__init__",
                expert_reduction,
                feature=self.name,
                reason="expert parameters reduce over the expert-data-parallel group even at "
                "EP 1 (at expert TP < TP their per-rank partial gradients were never summed)",
            )
        if hasattr(moe_utils, "te_general_gemm"):
            return  # TE imported: the name exists and the fused GEMM is used
        pm.register_replace(
            _MOE + "moe_utils.te_general_gemm",
            None,
            feature=self.name,
            reason="router_gating_linear tests 'te_general_gemm is not None', a NameError "
            "without TE; None selects its torch.mm path",
            create=True,
        )


class MoEGroupedGemm(Feature):
    name = "moe-grouped-gemm"
    level = 0
    description = (
        "--moe-grouped-gemm experts (Megatron's GroupedMLP) through torch's grouped matmul on "
        "every device and dtype, with a per-expert loop for shapes the kernel refuses"
    )
    flags = ("--moe-grouped-gemm",)

    def is_enabled(self, args: argparse.Namespace, device: DeviceInfo) -> bool:
        # With NVIDIA's grouped_gemm package on CUDA, Megatron's own bf16 kernel stays.
        return not (device.is_cuda and importlib.util.find_spec("grouped_gemm") is not None)

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        from anyspeed.features.moe import grouped_gemm

        pm.register_replace(
            _MOE + "grouped_gemm_util.grouped_gemm_is_available",
            grouped_gemm.grouped_gemm_available,
            feature=self.name,
            reason="GroupedMLP checks for the CUDA grouped_gemm package; torch's kernel stands in",
        )
        pm.register_replace(
            _MOE + "experts.GroupedMLP.forward",
            grouped_gemm.grouped_mlp_forward,
            feature=self.name,
            reason="GroupedMLP.forward asserts bf16 and calls grouped_gemm.ops.gmm (CUDA only)",
        )
