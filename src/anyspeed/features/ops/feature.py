"""Level-1 features: device-affine kernels behind Megatron's own seams.

Each is on by default at ``--optimization-level`` >= 1 (its MindSpeed flag is accepted and
switches it on explicitly; asking for it at level 0 is an error). The seams are Megatron's:

* ``flash-attention`` (``--use-flash-attn``): :class:`SDPAttention` as the local spec's attention
  core, installed by the ``attention-core`` feature (the one owner of that seam).
* ``fused-swiglu`` (``--use-fused-swiglu``): ``bias_activation_fusion`` with anyspeed's
  ``bias_swiglu_impl`` (on CUDA with Megatron's own, which ``torch.compile`` fuses there).
* ``fused-rope`` (``--use-fused-rotary-pos-emb``): ``apply_rope_fusion`` with anyspeed's
  ``fused_apply_rotary_pos_emb``.
* ``fused-cross-entropy`` (Megatron's ``--cross-entropy-loss-fusion``): the ``native`` fused
  cross-entropy entry point, computed chunk-wise without an fp32 copy of the logits.
* ``fused-norm`` (``--use-fused-rmsnorm``): norms through ``F.rms_norm`` / ``F.layer_norm``.

Config fields are set in a wrapper of ``TransformerConfig.__post_init__`` (after Megatron's own
checks, which assume TE kernels behind those fields).
"""

from __future__ import annotations

import argparse
import functools
import importlib
from typing import Any

import torch.nn.functional as F

from anyspeed.device import DeviceInfo
from anyspeed.features.base import KernelFeature
from anyspeed.patching import PatchManager

_POST_INIT = "megatron.core.transformer.transformer_config.TransformerConfig.__post_init__"
_FUSIONS = "megatron.core.fusions."


class OpFeature(KernelFeature):
    """A kernel that replaces Megatron's entry point ``target`` by ``impl`` ("module:function"),
    reached through the config fields :meth:`config_fields` switches on."""

    target: str = ""
    impl: str = ""
    reason: str = ""

    def config_fields(self, config: Any) -> dict[str, Any]:
        """TransformerConfig fields this kernel needs (set after Megatron's checks)."""
        return {}

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        if not self.target:
            return
        self.route(pm)
        module, _, name = self.impl.partition(":")
        impl = getattr(importlib.import_module(module), name)
        pm.register_replace(self.target, impl, feature=self.name, reason=self.reason)

    def route(self, pm: PatchManager, why: str = "") -> None:
        """Set :meth:`config_fields` on every ``TransformerConfig`` once Megatron's own checks
        have run."""
        feature = self

        def wrap(post_init):
            @functools.wraps(post_init)
            def __post_init__(config):
                post_init(config)
                for name, value in feature.config_fields(config).items():
                    setattr(config, name, value)

            return __post_init__

        why = why or f"switch on the config field(s) that route to {self.name}"
        pm.register_wrap(_POST_INIT, wrap, feature=self.name, reason=why)


def megatron_compiles(device: DeviceInfo) -> bool:
    """Whether Megatron-Core's fused bias/activation functions run ``torch.compile``'d on
    ``device``: on CUDA, where anyspeed leaves Megatron's ``jit_fuser`` on."""
    return device.is_cuda and fusions_compiled()


def fusions_compiled() -> bool:
    """Whether this process's Megatron-Core decorated its fused functions with
    ``torch.compile`` (checked on one of them)."""
    from megatron.core.fusions import fused_bias_swiglu

    return hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable")


class FlashAttention(OpFeature):
    name = "flash-attention"
    flags = ("--use-flash-attn",)
    description = (
        "attention core through the device's fused SDPA (flash kernel on CPU and "
        "CUDA): no S x S matrices, GQA without repeated K/V"
    )

    def available(self, device: DeviceInfo) -> tuple[bool, str]:
        from anyspeed.features.ops.blocked_attention import dropout_path

        return True, dropout_path(device.type)

    def attention_core(self) -> tuple[type, str]:
        """The core class for the attention-core seam, and why."""
        from anyspeed.features.ops.attention import SDPAttention

        return SDPAttention, "local-spec attention core -> fused scaled_dot_product_attention"


class FusedSwiGLU(OpFeature):
    name = "fused-swiglu"
    flags = ("--use-fused-swiglu",)
    description = (
        "SwiGLU as one autograd node that saves only its input (on CUDA Megatron's own, "
        "torch.compile'd)"
    )
    target = _FUSIONS + "fused_bias_swiglu.bias_swiglu_impl"
    impl = "anyspeed.features.ops.swiglu:bias_swiglu"
    reason = "Megatron's fused SwiGLU entry -> input-only-saving SwiGLU"

    def config_fields(self, config: Any) -> dict[str, Any]:
        if config.gated_linear_unit and config.activation_func is F.silu:
            return {"bias_activation_fusion": True}
        return {}

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        if megatron_compiles(device):
            # Megatron's fused entry saves only its input too, and there its forward and
            # backward are each one compiled kernel, where anyspeed's eager ones are several
            # passes over the [tokens, 2 x ffn] tensor.
            why = "switch on bias_activation_fusion: Megatron's torch.compile'd SwiGLU (CUDA)"
            self.route(pm, why)
            return
        super().register_patches(pm, args, device)
        from anyspeed.features.ops.swiglu import weighted_bias_swiglu

        pm.register_replace(
            _FUSIONS + "fused_bias_swiglu.weighted_bias_swiglu_impl",
            weighted_bias_swiglu,
            feature=self.name,
            reason="MoE experts' probability-weighted SwiGLU (torch.compile'd in Megatron)",
        )


class FusedRoPE(OpFeature):
    name = "fused-rope"
    flags = ("--use-fused-rotary-pos-emb",)
    description = (
        "RoPE in one autograd node saving only cos/sin (rope scaling honoured; stands "
        "aside for multi-latent attention)"
    )
    target = "megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb"
    impl = "anyspeed.features.ops.rope:fused_apply_rotary_pos_emb"
    reason = "Megatron's fused RoPE entry (TE-only) -> anyspeed's one-pass RoPE"

    def config_fields(self, config: Any) -> dict[str, Any]:
        # Multi-latent attention de-interleaves its rotary channels (and applies YaRN's mscale)
        # on Megatron's unfused path only: the fused entry would rotate them wrongly.
        if getattr(config, "multi_latent_attention", False):
            return {}
        return {"apply_rope_fusion": True}


class FusedCrossEntropy(OpFeature):
    name = "fused-cross-entropy"
    flags = ("--cross-entropy-loss-fusion",)
    description = "vocab-parallel cross-entropy in row chunks without an fp32 copy of the logits"
    target = _FUSIONS + "fused_cross_entropy.fused_vocab_parallel_cross_entropy"
    impl = "anyspeed.features.ops.cross_entropy:vocab_parallel_cross_entropy"
    reason = "Megatron's native fused cross-entropy entry -> chunked, no fp32 logits copy"

    def config_fields(self, config: Any) -> dict[str, Any]:
        if config.cross_entropy_loss_fusion and config.cross_entropy_fusion_impl == "te":
            return {}  # an explicit Transformer Engine choice stays
        return {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native"}


class FusedNorm(OpFeature):
    name = "fused-norm"
    flags = ("--use-fused-rmsnorm",)
    description = (
        "fp32 RMSNorm on a CPU under inference mode in three passes (torch's composite takes "
        "twice as long); otherwise torch's F.rms_norm/F.layer_norm"
    )
    target = "anyspeed.features.ops.norm.rms_norm"
    impl = "anyspeed.features.ops.norm:fused_rms_norm"
    reason = "fp32 RMSNorm on a CPU under inference mode in three passes, not torch's composite"
