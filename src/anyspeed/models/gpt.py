"""The only GPT builder: :class:`ModelConfig` + :class:`Layout` -> Megatron-Core objects.

Training, conversion, tests and benchmarks all build their ``TransformerConfig``, layer spec and
``GPTModel`` here, so an architecture field reaches every path through this one module. Megatron
config knobs that Megatron implements on every device are passed through here; behaviour Megatron
lacks off CUDA is an anyspeed feature (see :mod:`anyspeed.features`), which may patch the seams
these objects expose.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from anyspeed.layout import Layout
from anyspeed.models.config import ModelConfig
from anyspeed.models.dsa import dsa_config, use_sparse_core
from anyspeed.models.gemma import (
    add_gemma_hooks,
    gelu_tanh,
    gemma_config,
    with_post_norms,
)
from anyspeed.models.hybrid import linear_attention_config, with_linear_attention
from anyspeed.models.longrope import long_rotary_embedding, set_longrope
from anyspeed.models.mla import duplicate_kv_down_proj, mla_config, use_latent_core

# Megatron config defaults that assume CUDA kernels (apex / TE / torch.compile fusions), off so
# the portable path is used; the level-1 kernels switch their own seams back on. CPU
# initialisation gives layout-independent, reproducible weights.
PORTABLE_CONFIG = dict(
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    use_cpu_initialization=True,
)


def params_dtype(bf16: bool = False, fp16: bool = False) -> torch.dtype:
    """The parameter dtype of a run in bf16, fp16 or fp32."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


def transformer_config(
    model: ModelConfig,
    layout: Layout | None = None,
    *,
    bf16: bool = False,
    fp16: bool = False,
    **overrides: Any,
):
    """Megatron ``TransformerConfig`` (``MLATransformerConfig`` for multi-latent attention) for
    ``model`` at ``layout`` (overrides win, except that MLA keeps RoPE fusion off)."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    layout = layout or Layout()
    dtype = params_dtype(bf16, fp16)
    placed = layout.places_layers
    kw: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.gated,
        activation_func=_activation(model),
        glu_linear_offset=model.glu_linear_offset,
        activation_func_clamp_value=model.activation_func_clamp_value,
        softmax_type=model.softmax_type,
        window_size=None if model.window_size is None else (model.window_size, 0),
        window_attn_skip_freq=_skip_freq(model),
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        mrope_section=list(model.mrope_section) if model.mrope_section else None,
        qk_layernorm=model.qk_layernorm,
        init_method_std=model.init_method_std,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        cp_comm_type=layout.cp_algo.value,
        sequence_parallel=layout.sequence_parallel,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        # (a V or noop slots: anyspeed places the layers itself, anyspeed_stage_layers below)
        num_layers_in_first_pipeline_stage=None if placed else layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=None if placed else layout.last_stage_layers,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        fp16=fp16,
        deallocate_pipeline_outputs=True,
        mtp_num_layers=model.mtp_num_layers,
        mtp_loss_scaling_factor=model.mtp_loss_scaling_factor,
        layernorm_zero_centered_gamma=model.layernorm_zero_centered_gamma,
        attention_output_gate=model.attention_output_gate,
        **PORTABLE_CONFIG,
    )
    kw.update(moe_config(model))
    kw.update(linear_attention_config(model))
    kw.update(gemma_config(model))
    kw.update(overrides)
    if model.multi_latent_attention:
        kw.update(mla_config(model), **dsa_config(model))
        mla_cfg = MLATransformerConfig(**kw)
        _mark_placement(mla_cfg, model, layout)
        return mla_cfg
    config = TransformerConfig(**kw)
    _mark_placement(config, model, layout)
    if model.position_embedding_type == "yarn":
        _set_yarn(config, model)
    if model.longrope:
        set_longrope(config, model)
    return config


def _mark_placement(config: Any, model: ModelConfig, layout: Layout) -> None:
    """anyspeed's placement for the chunk-placement patches: the V flag and, per stage, its
    real layers (``anyspeed_stage_layers``; None where Megatron places them)."""
    config.anyspeed_dualpipev = layout.dualpipev
    config.anyspeed_stage_layers = (
        layout.virtual_stage_layers(model.num_layers) if layout.places_layers else None
    )


def _set_yarn(config: Any, model: ModelConfig) -> None:
    """GPTModel and the attention read these by getattr (no TransformerConfig fields)."""
    config.yarn_rotary_scaling_factor = model.rotary_scaling_factor
    config.yarn_original_max_position_embeddings = model.yarn_original_max_position_embeddings
    config.yarn_beta_fast = model.yarn_beta_fast
    config.yarn_beta_slow = model.yarn_beta_slow
    config.yarn_mscale = model.mscale
    config.yarn_mscale_all_dim = model.mscale_all_dim
    config.yarn_correction_range_round_to_int = model.yarn_correction_range_round_to_int


def _activation(model: ModelConfig):
    """The MLP activation: SiLU (SwiGLU), quick-GELU (GPT-OSS's GLU), tanh GELU (Gemma 2's
    GLU) or GELU. Megatron's
    quick-GELU is ``torch.compile``'d at import (inductor needs a real CUDA device): the eager
    function under it is used (a fusion path that compares against it is never taken here)."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    eager = getattr(quick_gelu, "_torchdynamo_orig_callable", quick_gelu)
    if model.gelu_tanh:
        return gelu_tanh
    return F.silu if model.swiglu else eager if model.quick_geglu else F.gelu


def _skip_freq(model: ModelConfig) -> int | list[int] | None:
    """Megatron's ``window_attn_skip_freq``: N, or the per-layer 1 = windowed list."""
    freq = model.window_attn_skip_freq
    if freq is None or model.window_size is None or str(freq).isdigit():
        return None if freq is None else int(freq)
    return [int(x) for x in model.window_layers()]


def moe_config(model: ModelConfig) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of ``model``'s MoE layers (none for a dense model)."""
    if not model.is_moe:
        return {}
    return dict(
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.expert_ffn_size,
        moe_router_topk=model.moe_router_topk,
        moe_layer_freq=[int(x) for x in model.moe_layers()],
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=model.moe_shared_expert_gate,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
        moe_router_num_groups=model.moe_router_num_groups,
        moe_router_group_topk=model.moe_router_group_topk,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff,
        moe_router_bias_update_rate=model.moe_router_bias_update_rate,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_router_dtype=model.moe_router_dtype,
        # MindSpeed's alltoall_seq is Megatron's alltoall (sequence-parallel aware since 0.10)
        moe_token_dispatcher_type=model.moe_token_dispatcher_type.replace("_seq", ""),
        moe_grouped_gemm=model.moe_grouped_gemm,
        moe_expert_capacity_factor=model.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=model.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=model.moe_token_drop_policy,
    )


def layer_spec(model: ModelConfig, config=None, vp_stage: int | None = None):
    """Megatron's decoder spec for ``model`` (the local, non-TE modules): one layer spec for a
    dense model; for MoE, the block spec of this pipeline stage's dense and MoE layers."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    mla = model.multi_latent_attention
    if not model.is_moe:
        spec = specs.get_gpt_layer_local_spec(
            normalization=model.normalization,
            qk_layernorm=model.qk_layernorm,
            multi_latent_attention=mla,
        )
    else:
        spec = specs.get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization=model.normalization,
            vp_stage=vp_stage,
        )
    if any(model.linear_attention_layers()):
        spec = with_linear_attention(model, config, spec, vp_stage)
    if model.experimental_attention_variant == "dsa":
        spec = use_sparse_core(use_latent_core(spec))
    elif mla:
        spec = use_latent_core(spec)
    return with_post_norms(spec) if model.post_norm else spec


def build(
    model: ModelConfig,
    config,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
):
    """One Megatron ``GPTModel`` (or pipeline chunk) of ``model`` with ``config``."""
    from megatron.core.models.gpt import GPTModel

    scaling = model.rope_scaling or {}
    spec = layer_spec(model, config, vp_stage)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        mtp_block_spec=_mtp_spec(model, config, spec, vp_stage),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model.tie_embeddings,
        position_embedding_type=model.position_embedding_type,
        rotary_base=int(model.rotary_base),
        rotary_percent=model.rotary_percent,
        rope_scaling=bool(scaling),
        rope_scaling_factor=float(scaling.get("factor", 8.0)),
        seq_len_interpolation_factor=model.rotary_seq_len_interpolation_factor,
        vp_stage=vp_stage,
    )
    if model.multi_latent_attention and config.tensor_model_parallel_size > 1:
        duplicate_kv_down_proj(gpt)
    add_gemma_hooks(gpt, model)
    if model.longrope and getattr(gpt, "rotary_pos_emb", None) is not None:
        gpt.rotary_pos_emb = long_rotary_embedding(model)
    return gpt


def _mtp_spec(model: ModelConfig, config, spec, vp_stage: int | None):
    """The multi-token prediction block of this (last) pipeline stage, each MTP layer a copy of
    the last decoder layer's spec; None without MTP or on another stage."""
    if not model.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)


def _check_offsets(config, layout: Layout, rank: int) -> None:
    """RuntimeError unless Megatron's layer offsets follow anyspeed's placement (the
    ``chunk-placement`` patch): without it a chunk would silently hold another stage's layers."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for chunk in range(layout.chunks):
        want = sum(config.anyspeed_stage_layers[: layout.stage_of(rank, chunk)])
        got = get_transformer_layer_offset(
            config, vp_stage=chunk if layout.vpp else None, pp_rank=rank
        )
        if got != want:
            raise RuntimeError(
                f"chunk {chunk} of pipeline rank {rank} would start at layer {got}, not "
                f"{want}: apply anyspeed's adaptor (anyspeed.adaptor.apply) before building"
            )


def build_chunks(model: ModelConfig, config, layout: Layout) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), from Megatron's parallel
    state; un-wrapped, on the CPU."""
    from megatron.core import parallel_state as ps

    chunks = []
    rank, last = ps.get_pipeline_model_parallel_rank(), 2 * layout.pp - 1
    for i in range(layout.chunks):
        vp = i if layout.vpp else None
        if layout.dualpipev:  # a V: stage 0 (embedding) and the last stage both on rank 0
            stage = layout.stage_of(rank, i)
            first, final = stage == 0, stage == last
        else:
            first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
            final = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        chunks.append(build(model, config, pre_process=first, post_process=final, vp_stage=vp))
    if layout.places_layers:
        _check_offsets(config, layout, rank)
    if layout.dualpipev and rank == 0 and (model.tie_embeddings or model.mtp_num_layers):
        # Megatron zeroes a tied output layer (or the MTP block's embedding) off the first
        # stage and fills it by an all-reduce with the first stage; here both are on this rank.
        out = chunks[1].shared_embedding_or_output_weight()
        out.data.copy_(chunks[0].shared_embedding_or_output_weight().data)
    return chunks
