"""Level-1 features: device-affine kernels behind Megatron's own seams.

Each is on by default at ``--optimization-level`` >= 1 (its MindSpeed flag is accepted and
switches it on explicitly; asking for it at level 0 is an error). The seams are Megatron's:

* ``flash-attention`` (``--use-flash-attn``): the local spec's ``DotProductAttention`` class is
  replaced by :class:`SDPAttention` (same constructor, parameters and checkpoint layout).
* ``fused-swiglu`` (``--use-fused-swiglu``): ``bias_activation_fusion`` with anyspeed's
  ``bias_swiglu_impl``.
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

import torch.nn.functional as F

from anyspeed.device import DeviceInfo
from anyspeed.features import Feature, FeatureError, flag_set, register_feature
from anyspeed.patching import PatchManager

_POST_INIT = "megatron.core.transformer.transformer_config.TransformerConfig.__post_init__"


def _has_option(parser: argparse._ActionsContainer, flag: str) -> bool:
    return flag in getattr(parser, "_option_string_actions", {})


class KernelFeature(Feature):
    """A level-1 kernel: on by default at level >= 1; its flag at level 0 is an error."""

    level = 1
    add_flag = True  # False when Megatron-LM already defines the flag

    def add_arguments(self, parser: argparse._ActionsContainer) -> None:
        flag = self.flags[0]
        if not _has_option(parser, flag):
            parser.add_argument(flag, action="store_true", help=self.description)

    def validate(self, args: argparse.Namespace, device: DeviceInfo) -> None:
        level = getattr(args, "optimization_level", 2)
        if flag_set(args, self.flags[0]) and level < self.level:
            raise FeatureError(
                f"{self.flags[0]} is a level-{self.level} feature: use --optimization-level "
                f">= {self.level} (got {level})"
            )

    def config_fields(self, config) -> dict:
        """TransformerConfig fields this kernel needs (set after Megatron's checks)."""
        return {}

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        feature = self

        def wrap(post_init):
            @functools.wraps(post_init)
            def __post_init__(config):
                post_init(config)
                for name, value in feature.config_fields(config).items():
                    setattr(config, name, value)

            return __post_init__

        pm.register_wrap(
            _POST_INIT,
            wrap,
            feature=self.name,
            reason=f"switch on the config field(s) that route to {self.name}",
        )


class FlashAttention(KernelFeature):
    name = "flash-attention"
    flags = ("--use-flash-attn",)
    description = (
        "attention core through the device's fused SDPA (flash kernel on CPU and "
        "CUDA): no S x S matrices, GQA without repeated K/V"
    )

    def register_patches(self, pm, args, device) -> None:
        from anyspeed.features.context_parallel.feature import cp_size
        from anyspeed.features.ops.attention import SDPAttention

        if cp_size(args) > 1 and getattr(args, "optimization_level", 2) >= 2:
            return  # the context-parallel core (an SDPAttention subclass) takes this seam

        pm.register_replace(
            "megatron.core.transformer.dot_product_attention.DotProductAttention",
            SDPAttention,
            feature=self.name,
            reason="local-spec attention core -> fused scaled_dot_product_attention",
        )


class FusedSwiGLU(KernelFeature):
    name = "fused-swiglu"
    flags = ("--use-fused-swiglu",)
    description = "SwiGLU as one autograd node that saves only its input"

    def config_fields(self, config) -> dict:
        if config.gated_linear_unit and config.activation_func is F.silu:
            return {"bias_activation_fusion": True}
        return {}

    def register_patches(self, pm, args, device) -> None:
        from anyspeed.features.ops.swiglu import bias_swiglu

        super().register_patches(pm, args, device)
        pm.register_replace(
            "megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl",
            bias_swiglu,
            feature=self.name,
            reason="Megatron's fused SwiGLU entry -> input-only-saving SwiGLU",
        )


class FusedRoPE(KernelFeature):
    name = "fused-rope"
    flags = ("--use-fused-rotary-pos-emb",)
    description = "RoPE in one autograd node saving only cos/sin (rope scaling honoured)"

    def config_fields(self, config) -> dict:
        return {"apply_rope_fusion": True}

    def register_patches(self, pm, args, device) -> None:
        from anyspeed.features.ops.rope import fused_apply_rotary_pos_emb

        super().register_patches(pm, args, device)
        pm.register_replace(
            "megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb",
            fused_apply_rotary_pos_emb,
            feature=self.name,
            reason="Megatron's fused RoPE entry (TE-only) -> anyspeed's one-pass RoPE",
        )


class FusedCrossEntropy(KernelFeature):
    name = "fused-cross-entropy"
    flags = ("--cross-entropy-loss-fusion",)
    description = "vocab-parallel cross-entropy in row chunks without an fp32 copy of the logits"

    def config_fields(self, config) -> dict:
        if config.cross_entropy_loss_fusion and config.cross_entropy_fusion_impl == "te":
            return {}  # an explicit Transformer Engine choice stays
        return {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native"}

    def register_patches(self, pm, args, device) -> None:
        from anyspeed.features.ops.cross_entropy import vocab_parallel_cross_entropy

        super().register_patches(pm, args, device)
        pm.register_replace(
            "megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy",
            vocab_parallel_cross_entropy,
            feature=self.name,
            reason="Megatron's native fused cross-entropy entry -> chunked, no fp32 logits copy",
        )


class FusedNorm(KernelFeature):
    name = "fused-norm"
    flags = ("--use-fused-rmsnorm",)
    description = (
        "RMSNorm/LayerNorm through torch's fused F.rms_norm/F.layer_norm (the level-0 "
        "compat norm already uses them; the flag is accepted for MindSpeed scripts)"
    )

    def register_patches(self, pm, args, device) -> None:
        return None


FLASH_ATTENTION = register_feature(FlashAttention())
FUSED_SWIGLU = register_feature(FusedSwiGLU())
FUSED_ROPE = register_feature(FusedRoPE())
FUSED_CROSS_ENTROPY = register_feature(FusedCrossEntropy())
FUSED_NORM = register_feature(FusedNorm())
