"""Level-1 feature ``no-grad-fast-path``: Megatron's forward without training-only work when no
gradient is recorded (generation, evaluation, the no-grad pass of recomputation).

Megatron routes every linear layer and every tensor-parallel copy / reduce / gather through an
``autograd.Function`` even under ``torch.no_grad``; in a one-token decode step that per-call
Python work costs about as much as the matmuls of a small model. With grad off these wraps run
the functions' forward bodies directly: the same tensor ops in the same order, so outputs are
bit-identical. With Megatron's static KV cache, the new query and keys are rotated once, before
the keys are stored, from cos / sin tables computed once per rotary table, instead of Megatron
re-rotating the whole cached key sequence in every layer at every step (the rotation is
``t * cos + rotate_half(t) * sin``, Megatron's unfused formula). Grad-enabled calls go to
Megatron's own code untouched.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch

from anyspeed.device import DeviceInfo
from anyspeed.features.base import Feature
from anyspeed.patching import PatchManager

_LAYERS = "megatron.core.tensor_parallel.layers."
_MAPPINGS = "megatron.core.tensor_parallel.mappings."
_ADJUST = "megatron.core.transformer.attention.Attention._adjust_key_value_for_inference"
_GPT_FORWARD = "megatron.core.models.gpt.gpt_model.GPTModel.forward"
# attribute of a static inference context whose cached keys are stored rotated to their slots
KEYS_ROTATED = "_anyspeed_keys_rotated"


def _linear(previous: Callable) -> Callable:
    """Megatron's linear entry point: a plain matmul under no-grad without sequence parallelism
    (the forward of its autograd function, minus saving tensors for a backward that never runs)."""

    @functools.wraps(previous)
    def linear(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        *args,
        **kwargs,
    ):
        if torch.is_grad_enabled() or sequence_parallel:
            return previous(
                input,
                weight,
                bias,
                gradient_accumulation_fusion,
                allreduce_dgrad,
                sequence_parallel,
                *args,
                **kwargs,
            )
        out = torch.matmul(input, weight.t())
        return out if bias is None else out + bias

    return linear


def _region(forward: str) -> Callable[[Callable], Callable]:
    """A tensor-parallel region mapping that, under no-grad, calls ``forward`` (the module's
    plain function its autograd function runs forward) on the same group; "" is the identity."""

    def wrap(previous: Callable) -> Callable:
        from megatron.core import utils
        from megatron.core.tensor_parallel import mappings

        body = getattr(mappings, forward) if forward else None

        @functools.wraps(previous)
        def region(input_, group=None):
            if torch.is_grad_enabled():
                return previous(input_, group)
            if body is None:
                return input_
            return body(input_, utils.get_tensor_model_parallel_group_if_none(group))

        return region

    return wrap


def _rotated(t: torch.Tensor, emb: torch.Tensor, start: int, config: Any, cp: Any) -> torch.Tensor:
    """``t`` [s, b, heads, d] rotated to positions ``start``.. by Megatron's rotary ``emb``,
    from cos / sin computed once per table (Megatron caches one table per length)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer import attention

    from anyspeed.features.ops.rope import cached_signed_tables, rotate

    freqs = emb[start : start + t.shape[0]]
    mscale = attention._yarn_get_concentration_factor_from_config(config)
    if config.rotary_interleaved or config.multi_latent_attention or mscale != 1.0:
        return apply_rotary_pos_emb(t, freqs, config=config, mscale=mscale, cp_group=cp)
    cos, sin = cached_signed_tables(emb, t.dtype)
    n = start + t.shape[0]
    return rotate(t, cos[start:n], sin[start:n])


def _store_rotated_keys(previous: Callable) -> Callable:
    """Megatron's static-cache bookkeeping fed the query and keys already rotated to their
    positions; no rotary embedding goes back, so the attention does not rotate the whole cache
    again (each key is rotated once, when stored)."""

    @functools.wraps(previous)
    def adjust(self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs):
        ctx = inference_context
        if (
            ctx is None
            or kwargs.get("inference_params") is not None
            or not ctx.is_static_batching()
            or self.config.flash_decode
            or not isinstance(rotary_pos_emb, tuple)
            or rotary_pos_emb[1] is None
            or rotary_pos_emb[0] is None
        ):
            return previous(
                self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs
            )
        start, cp = ctx.sequence_len_offset, self.pg_collection.cp
        setattr(ctx, KEYS_ROTATED, True)
        query = _rotated(query, rotary_pos_emb[0], start, self.config, cp)
        key = _rotated(key, rotary_pos_emb[1], start, self.config, cp)
        query, key, value, _, mask_type, table = previous(
            self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs
        )
        return query, key, value, None, mask_type, table

    return adjust


def _lean_decode(previous: Callable) -> Callable:
    """``GPTModel.forward`` for a one-token static-cache decode step under no-grad in eval mode:
    :func:`decode_step` when the model's layers are plain, Megatron's forward otherwise."""
    from anyspeed.features.inference.decode_step import allocate_cache, decode_step

    @functools.wraps(previous)
    def forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
        ctx = kwargs.get("inference_context")
        if (
            ctx is not None
            and not args
            and not self.training
            and not torch.is_grad_enabled()
            and ctx.is_static_batching()
            and ctx.is_decode_only()
            and kwargs.get("runtime_gather_output")
            and set(kwargs) <= {"inference_context", "runtime_gather_output"}
        ):
            out = decode_step(self, input_ids, position_ids, attention_mask, ctx)
            if out is not None:
                return out
        elif (
            ctx is not None
            and not ctx.key_value_memory_dict
            and not torch.is_grad_enabled()
            and ctx.is_static_batching()
        ):  # the prefill of a cache the lean step will read: its slots in the step's order
            allocate_cache(self, ctx)
        return previous(self, input_ids, position_ids, attention_mask, *args, **kwargs)

    return forward


class NoGradFastPath(Feature):
    name = "no-grad-fast-path"
    level = 1
    description = (
        "under no-grad, Megatron's linear layers and TP region mappings run their forward "
        "directly (no autograd-function work per call); the static KV cache stores keys rotated "
        "once instead of re-rotating the whole cache each step; a one-token decode step of plain "
        "dense/MoE layers runs from the weights without Megatron's per-module Python"
    )

    def register_patches(
        self, pm: PatchManager, args: argparse.Namespace, device: DeviceInfo
    ) -> None:
        why = "no-grad: a plain matmul instead of the autograd function"
        for name in (
            "linear_with_grad_accumulation_and_async_allreduce",
            "linear_with_frozen_weight",
        ):
            pm.register_wrap(_LAYERS + name, _linear, feature=self.name, reason=why)
        regions: dict[str, Any] = {
            "copy_to_tensor_model_parallel_region": "",
            "reduce_from_tensor_model_parallel_region": "_reduce",
            "gather_from_tensor_model_parallel_region": "_gather_along_last_dim",
        }
        for name, body in regions.items():
            why = f"no-grad: {body or 'identity'} without the autograd function"
            pm.register_wrap(_MAPPINGS + name, _region(body), feature=self.name, reason=why)
        why = "static KV cache: rotate each key once when stored, not the whole cache every step"
        pm.register_wrap(_ADJUST, _store_rotated_keys, feature=self.name, reason=why)
        why = "one-token static-cache decode: the layers' math from their weights, no module calls"
        pm.register_wrap(_GPT_FORWARD, _lean_decode, feature=self.name, reason=why)
