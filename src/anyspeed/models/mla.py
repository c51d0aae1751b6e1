"""Multi-latent attention (DeepSeek) on Megatron-Core's local spec, on every device.

Megatron-Core 0.16.1 builds ``MLASelfAttention`` from the local spec with its local
``DotProductAttention`` as the core, which takes no separate key/value head sizes: the build
fails (Megatron-LM#1589). :class:`LatentAttention` is the core here: fused scaled-dot-product
attention with the query/key head size, the value head size and the softmax scale MLA passes
(``mscale**2 / sqrt(q_head_dim)`` under YaRN). RoPE fusion stays off for MLA: the fused entry
would skip MLA's de-interleaving of the rotary channels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class LatentAttention(MegatronModule):
    """Core attention with separate key and value head sizes (the ``core_attention`` of
    ``MLASelfAttention``); inputs [s, b, heads, d], output [s, b, heads x v_channels]."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("--multi-latent-attention does not run with --context-parallel-size")
        self.attn_mask_type = attn_mask_type
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.softmax_scale = softmax_scale or self.k_channels**-0.5
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.dropout_p = p
        self.current_max_attn_logits = None  # Megatron's QK-clip reads it (off here)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("multi-latent attention: no attention bias or packed input")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, heads = query.shape[0], query.shape[1], query.shape[2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        mask, causal = None, False
        if attention_mask is not None:
            keep = ~attention_mask.to(torch.bool)
            empty = ~keep.any(dim=-1, keepdim=True)  # a query seeing no key: see all (no NaN)
            mask = keep | empty
        elif mask_type == AttnMaskType.causal:
            causal = True
        p = self.dropout_p if self.training else 0.0

        def attend() -> torch.Tensor:
            scale = self.softmax_scale
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale
            )

        if p > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * self.v_channels)


class DuplicatedLinear(MegatronModule):
    """A linear layer whose whole weight every tensor-parallel rank holds (Megatron's TE path
    builds MLA's KV down-projection so, ``parallel_mode="duplicated"``); under sequence
    parallelism each rank projects its own tokens and the weight's gradient is summed over TP
    like a norm's. Returns ``(output, None)`` as Megatron's linear layers do."""

    def __init__(self, weight: torch.Tensor, config: Any) -> None:
        super().__init__(config=config)
        self.weight = torch.nn.Parameter(weight.detach().clone())
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None

    def get_extra_state(self) -> None:
        """An empty ``_extra_state`` entry, as Megatron's linear layers keep (strict loads)."""
        return None

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore (see :meth:`get_extra_state`)."""


def duplicate_kv_down_proj(model: torch.nn.Module) -> None:
    """Replace every MLA layer's column-split KV down-projection by a :class:`DuplicatedLinear`
    of the same (gathered) weight. Megatron-Core 0.16.1's local spec gathers the split output and
    cuts the shared rotary key out of it; that gather's backward keeps each rank's own columns
    of the gradient, but the rotary key's gradient is partial on each rank (from its own heads):
    the rotary columns' gradients were never summed over TP. With the whole output on each rank,
    Megatron takes its other path: the rotary key is gathered from the sequence-parallel region,
    whose backward sums it. (A collective over the TP group: every TP rank builds the same
    layers.)"""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    for module in model.modules():
        down = getattr(module, "linear_kv_down_proj", None)
        if isinstance(module, MLASelfAttention) and isinstance(down, ColumnParallelLinear):
            with torch.no_grad():  # [out/TP, in] per rank -> the whole [out, in]
                full = gather_from_tensor_model_parallel_region(down.weight.t().contiguous()).t()
            module.linear_kv_down_proj = DuplicatedLinear(full, module.config)


def mla_config(model: Any) -> dict[str, Any]:
    """``MLATransformerConfig`` fields of ``model`` (rope fusion off: see the module doc)."""
    return dict(
        multi_latent_attention=True,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_head_dim,
        qk_pos_emb_head_dim=model.qk_pos_emb_head_dim,
        v_head_dim=model.v_head_dim,
        rope_type=model.rope_type,
        rotary_base=model.rotary_base,
        rotary_scaling_factor=model.rotary_scaling_factor,
        mscale=model.mscale,
        mscale_all_dim=model.mscale_all_dim,
        original_max_position_embeddings=model.yarn_original_max_position_embeddings,
        beta_fast=model.yarn_beta_fast,
        beta_slow=model.yarn_beta_slow,
        apply_rope_fusion=False,
    )


def use_latent_core(spec: Any) -> Any:
    """``spec`` (a layer spec or a block spec of layer specs) with :class:`LatentAttention` as
    every MLA layer's core attention."""
    layers = getattr(getattr(spec, "layer_specs", None), "__iter__", None)
    for layer in spec.layer_specs if layers else [spec]:
        attn = layer.submodules.self_attention
        attn.submodules.core_attention = LatentAttention
    return spec
