"""Level-0 feature ``vision-compat``: Megatron-Core's CLIP / SigLIP towers without TE, and right.

Two defects of Megatron-Core 0.16.1's vision path off Transformer Engine:

1. ``CLIPViTModel``'s ``ln_pre`` / ``ln_post`` default to ``torch.nn.LayerNorm`` (bound when the
   module is imported), which ``build_module`` then calls with ``config=``: the CLIP and SigLIP
   towers fail to build. They get Megatron's ``WrappedTorchNorm`` (the local spec's norm).
2. The local ViT layer spec masks attention causally (the TE spec does not): a patch cannot see
   the patches after it, unlike every Hugging Face tower, and a model trains silently wrong.
   The local spec gets ``no_mask``: bidirectional attention, as in CLIP, SigLIP and InternViT.

And one of ``LLaVAModel``'s KV-cache decoding: after the prompt, each step's token embeddings
reach the language model as [batch, 1, hidden] where it reads [sequence, batch, hidden] (right
only at batch 1). They are handed over in the language model's layout.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature
from anyspeed.patching import PatchManager


def torch_norm_default(previous: Any) -> Any:
    """``CLIPViTModel.__init__`` whose norms default to the local spec's ``WrappedTorchNorm``
    when the class-level default is ``torch.nn.LayerNorm`` (no TE)."""

    @functools.wraps(previous)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        import torch
        from megatron.core.models.vision import clip_vit_model
        from megatron.core.transformer import torch_norm

        if clip_vit_model.NORM_IMPL is torch.nn.LayerNorm:
            kwargs.setdefault("ln_pre_impl", torch_norm.WrappedTorchNorm)
            kwargs.setdefault("ln_post_impl", torch_norm.WrappedTorchNorm)
        previous(self, *args, **kwargs)

    return __init__


def bidirectional(previous: Any) -> Any:
    """``get_vit_layer_with_local_spec`` whose self-attention has no mask (all patches)."""

    @functools.wraps(previous)
    def get_vit_layer_with_local_spec(*args: Any, **kwargs: Any) -> Any:
        from megatron.core.transformer.enums import AttnMaskType

        spec = previous(*args, **kwargs)
        attention = spec.submodules.self_attention
        attention.params = {**attention.params, "attn_mask_type": AttnMaskType.no_mask}
        return spec

    return get_vit_layer_with_local_spec


def decode_layout(previous: Any) -> Any:
    """``LLaVAModel._preprocess_data`` whose KV-cache branch returns [s, b, h] embeddings."""

    @functools.wraps(previous)
    def _preprocess_data(
        self: Any,
        image_embeddings: Any,
        language_embeddings: Any,
        input_ids: Any,
        loss_mask: Any,
        labels: Any,
        use_inference_kv_cache: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        out = previous(
            self,
            image_embeddings,
            language_embeddings,
            input_ids,
            loss_mask,
            labels,
            use_inference_kv_cache,
            *args,
            **kwargs,
        )
        if use_inference_kv_cache and out[0] is not None:
            return out[0].transpose(0, 1).contiguous(), None, None
        return out

    return _preprocess_data


class VisionCompat(Feature):
    name = "vision-compat"
    level = 0
    description = "CLIP/SigLIP towers build without TE; the local ViT attention is bidirectional"

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        pm.register_wrap(
            "megatron.core.models.vision.clip_vit_model.CLIPViTModel.__init__",
            torch_norm_default,
            feature=self.name,
            reason="without TE the tower's ln_pre/ln_post default to torch.nn.LayerNorm, which "
            "build_module calls with config=: CLIP and SigLIP failed with a TypeError",
        )
        pm.register_wrap(
            "megatron.core.models.vision.vit_layer_specs.get_vit_layer_with_local_spec",
            bidirectional,
            feature=self.name,
            reason="the local ViT spec masked attention causally (the TE spec does not): a "
            "patch could not see later patches, unlike the HF towers",
        )
        pm.register_wrap(
            "megatron.core.models.multimodal.llava_model.LLaVAModel._preprocess_data",
            decode_layout,
            feature=self.name,
            reason="KV-cache decoding: each step's embeddings reached the language model as "
            "[b, s, h] where it reads [s, b, h] (wrong at batch > 1)",
        )
