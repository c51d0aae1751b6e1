"""Attention core through the device's fused scaled-dot-product attention.

Drop-in for Megatron's local ``DotProductAttention`` (same constructor, parameters and sharded
state): instead of materialising the [b, heads, s, s] score and probability matrices it calls
``torch.nn.functional.scaled_dot_product_attention``, which picks the flash / memory-efficient
kernel of the device (CUDA, and the flash kernel on CPU). Causal attention needs no mask tensor;
grouped-query attention is passed through without repeating K/V in memory; Megatron's boolean
attention masks (True = masked: padding, ``--reset-attention-mask`` document masks) are
honoured, and packed ``thd`` sequences attend within each ``cu_seqlens`` segment only.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from anyspeed.features.ops.blocked_attention import blocked_attention, fused_has_dropout


class SDPAttention(DotProductAttention):
    """Megatron ``DotProductAttention`` computed with fused SDPA kernels."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        window = self.scale_mask_softmax.window_size
        cap = getattr(self, "logit_softcap", None)  # Gemma 2 (models/gemma.py)
        if (
            packed_seq_params is None
            and attention_bias is None
            and (self.softmax_offset is not None or window is not None or cap)
        ):
            out = self._sinks_or_window(query, key, value, attention_mask, attn_mask_type)
            if out is not None:
                return out
        plain = attention_bias is None and self.softmax_offset is None and window is None
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        causal_window = window is None or window[1] == 0
        if thd and attention_bias is None and causal_window:
            return self._packed(query, key, value, packed_seq_params)
        if not plain or cap or packed_seq_params is not None:
            # Features SDPA cannot express exactly (a capped decode step: the softmax's hook
            # caps Megatron's S x S scores): keep Megatron's path.
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b = query.shape[0], query.shape[1]
        # [s, b, heads, d] -> [b, heads, s, d] (views; SDPA accepts strided inputs)
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        is_causal, mask = False, None
        if attention_mask is not None:
            keep = ~attention_mask.to(torch.bool)
            # A query that may see no key at all (pure padding) would give NaN in SDPA; let it
            # see everything instead. Megatron gives such rows a uniform average; both are
            # finite and such positions carry no loss.
            empty = ~keep.any(dim=-1, keepdim=True)
            mask = keep | empty if bool(empty.any()) else keep
        elif mask_type == AttnMaskType.causal:
            is_causal = True
        dropout_p = self.attention_dropout.p if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]

        def attend():
            if dropout_p > 0 and not fused_has_dropout(q.device):
                # the fused kernels refuse dropout here: blocked attention, not S x S math
                return blocked_attention(
                    q, k, v, mask, causal=is_causal, scale=self.softmax_scale, dropout_p=dropout_p
                )
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )

        if dropout_p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _sinks_or_window(self, query, key, value, attention_mask, attn_mask_type):
        """GPT-OSS attention (learnable sinks, a causal sliding window) and Gemma 2's
        (soft-capped scores, windows) through blocked attention: memory linear in the sequence
        where Megatron's path builds [b, h, s, s] scores and masks. None (Megatron's path) for
        what it does not cover: a decode step (fewer queries than keys), a window that looks
        ahead, a non-causal mask."""
        window = self.scale_mask_softmax.window_size
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if (
            query.shape[0] != key.shape[0]
            or mask_type != AttnMaskType.causal
            or (window is not None and window[1] != 0)
        ):
            return None
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        keep = None if attention_mask is None else ~attention_mask.to(torch.bool)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        fork = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            context = blocked_attention(
                q,
                k,
                v,
                keep,
                causal=True,
                scale=self.softmax_scale,
                dropout_p=dropout_p,
                sink=self.softmax_offset,
                window=None if window is None else window[0],
                cap=getattr(self, "logit_softcap", None),
            )
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params
    ) -> torch.Tensor:
        """Packed (``thd``) sequences [t, heads, d]: causal SDPA within each cu_seqlens
        segment, so no token attends across a sample boundary and no [t, t] mask exists.
        Sinks, a window or soft-capped scores (GPT-OSS, Gemma): the blocked kernel per
        segment, the window counted from each segment's own start."""
        cu = params.cu_seqlens_q_padded
        bounds = (cu if cu is not None else params.cu_seqlens_q).tolist()
        dropout_p = self.attention_dropout.p if self.training else 0.0
        gqa = query.shape[1] != key.shape[1]
        window = self.scale_mask_softmax.window_size
        keys_before = None if window is None else window[0]
        cap, sink = getattr(self, "logit_softcap", None), self.softmax_offset
        blocked = sink is not None or keys_before is not None or cap is not None
        parts = []
        fork = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                if hi <= lo:
                    continue
                # [len, heads, d] -> [1, heads, len, d]
                q, k, v = (x[lo:hi].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                if blocked or (dropout_p > 0 and not fused_has_dropout(q.device)):
                    # as the padded path: blocked attention, not the S x S math kernel
                    out = blocked_attention(
                        q,
                        k,
                        v,
                        None,
                        causal=True,
                        scale=self.softmax_scale,
                        dropout_p=dropout_p,
                        sink=sink,
                        window=keys_before,
                        cap=cap,
                    )
                else:
                    out = F.scaled_dot_product_attention(
                        q,
                        k,
                        v,
                        dropout_p=dropout_p,
                        is_causal=True,
                        scale=self.softmax_scale,
                        enable_gqa=gqa,
                    )
                parts.append(out.squeeze(0).transpose(0, 1))
        context = torch.cat(parts, dim=0)
        return context.reshape(context.shape[0], self.hidden_size_per_partition)
