"""Megatron-Core GPT models from presets: one factory shared by training and conversion."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from anyspeed.models.presets import ModelPreset

# Megatron config defaults that assume CUDA kernels (apex / TE / torch.compile fusions), off so
# the portable path is used; the level-1 kernels switch their own seams back on. Dropout off and
# CPU initialisation give layout-independent, reproducible weights.
PORTABLE_CONFIG = dict(
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    use_cpu_initialization=True,
)


def transformer_config(preset: ModelPreset, *, tp: int = 1, pp: int = 1, bf16: bool = False,
                       **overrides):  # fmt: skip
    """Megatron ``TransformerConfig`` for ``preset`` (dropout off; overrides win)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    kw = dict(
        num_layers=preset.num_layers,
        hidden_size=preset.hidden_size,
        ffn_hidden_size=preset.ffn_hidden_size,
        num_attention_heads=preset.num_attention_heads,
        num_query_groups=preset.num_query_groups,
        kv_channels=preset.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=preset.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=preset.add_qkv_bias,
        qk_layernorm=preset.qk_layernorm,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        **PORTABLE_CONFIG,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def gpt_model(preset: ModelPreset, config, *, pre_process: bool = True, post_process: bool = True,
              vp_stage: int | None = None):  # fmt: skip
    """Megatron ``GPTModel`` (local spec) with the preset's vocabulary, RoPE and tying."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=preset.qk_layernorm, normalization="RMSNorm")
    scaling = preset.rope_scaling or {}
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=preset.vocab_size,
        max_sequence_length=preset.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=preset.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(preset.rotary_base),
        rope_scaling=bool(scaling),
        rope_scaling_factor=float(scaling.get("factor", 8.0)),
        vp_stage=vp_stage,
    )
