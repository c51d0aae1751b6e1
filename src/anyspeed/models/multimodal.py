"""The LLaVA builder: :class:`LlavaConfig` + :class:`Layout` -> Megatron-Core ``LLaVAModel``.

The language model's config and layer spec come from :mod:`anyspeed.models.gpt` (the one GPT
builder), so every family and feature reaches the multimodal model too. The tower uses Megatron's
local ViT spec, made bidirectional by the ``vision-compat`` feature.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from anyspeed.layout import Layout
from anyspeed.models import gpt
from anyspeed.models.vision import LlavaConfig, VisionConfig, extra_key, extra_shapes


def check_layout(cfg: LlavaConfig, layout: Layout) -> None:
    """ValueError (one line, naming the flag) for a layout the local LLaVA path cannot run."""
    if layout.vpp:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage: not supported for LLaVA "
            "(the tower sits on the first stage); use plain PP"
        )
    if layout.cp > 1 or layout.sequence_parallel:
        raise ValueError(
            "--context-parallel-size / --sequence-parallel: Megatron's LLaVAModel "
            "needs Transformer Engine attention for them; use TP and DP"
        )
    if layout.ep > 1:
        raise ValueError("--expert-model-parallel-size > 1 is not supported for LLaVA")
    check_tower_tp(cfg.vision.num_attention_heads, cfg.vision.ffn_hidden_size, layout.tp)


def check_tower_tp(heads: int, ffn: int, tp: int) -> None:
    """ValueError (one line) unless TP ``tp`` divides a vision tower's heads and FFN width."""
    for name, n in (("vision heads", heads), ("vision ffn", ffn)):
        if n % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide the {name} ({n})")


def _vision_activation(name: str):
    if name == "gelu_pytorch_tanh":
        return functools.partial(F.gelu, approximate="tanh")
    if name == "gelu":
        return F.gelu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return getattr(quick_gelu, "_torchdynamo_orig_callable", quick_gelu)


def vision_config(v: VisionConfig, layout: Layout, dtype: torch.dtype, **overrides: Any):
    """Megatron ``TransformerConfig`` of the tower (TP of the layout, never pipelined)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=v.num_layers,
        hidden_size=v.hidden_size,
        ffn_hidden_size=v.ffn_hidden_size,
        num_attention_heads=v.num_attention_heads,
        kv_channels=v.hidden_size // v.num_attention_heads,
        normalization="LayerNorm",
        layernorm_epsilon=v.norm_epsilon,
        add_bias_linear=True,
        add_qkv_bias=True,
        gated_linear_unit=False,
        activation_func=_vision_activation(v.activation),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        **gpt.PORTABLE_CONFIG,
    )
    kw.update(overrides)
    config = TransformerConfig(**kw)
    config.vision_model_type = v.kind  # LLaVAModel reads it by attribute
    return config


def vision_layer_spec():
    """Megatron's local ViT layer spec (bidirectional once ``vision-compat`` is applied)."""
    from megatron.core.models.vision import vit_layer_specs

    return vit_layer_specs.get_vit_layer_with_local_spec()


class KeptTensors(torch.nn.Module):
    """HF tower tensors a LLaVA model never runs, kept frozen so conversion back is exact."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
        super().__init__()
        for name, shape in shapes.items():
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            self.register_parameter(extra_key(name), p)


def build_llava(
    cfg: LlavaConfig,
    config,
    layout: Layout | None = None,
    *,
    max_sequence_length: int | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    **overrides: Any,
):
    """Megatron ``LLaVAModel`` of ``cfg`` (this pipeline stage's: the tower and projector on
    the first); ``config`` is the language model's TransformerConfig
    (:func:`anyspeed.models.gpt.transformer_config`). Parallel state must be initialised."""
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    layout = layout or Layout()
    check_layout(cfg, layout)
    lm = cfg.language
    dtype = config.params_dtype
    init = dict(perform_initialization=config.perform_initialization, **overrides)
    scaling = lm.rope_scaling or {}
    projector = gpt.transformer_config(
        lm,
        layout,
        bf16=config.bf16,
        fp16=config.fp16,
        ffn_hidden_size=lm.hidden_size,
        add_bias_linear=True,
        gated_linear_unit=False,
        activation_func=F.gelu,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        **init,
    )
    model = LLaVAModel(
        language_transformer_config=config,
        language_transformer_layer_spec=gpt.layer_spec(lm, config),
        language_vocab_size=lm.vocab_size,
        language_max_sequence_length=max_sequence_length or lm.max_position_embeddings,
        vision_transformer_config=vision_config(cfg.vision, layout, dtype, **init),
        vision_transformer_layer_spec=vision_layer_spec(),
        drop_vision_class_token=cfg.drop_class_token,
        vision_projection_config=projector,
        vision_projection_layer_spec=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
        ),
        vision_projection_type="mlp",
        share_embeddings_and_output_weights=lm.tie_embeddings,
        language_position_embedding_type=lm.position_embedding_type,
        language_rotary_percent=lm.rotary_percent,
        language_rotary_base=int(lm.rotary_base),
        language_rope_scaling=bool(scaling),
        language_rope_scaling_factor=float(scaling.get("factor", 8.0)),
        img_h=cfg.vision.image_size,
        img_w=cfg.vision.image_size,
        patch_dim=cfg.vision.patch_size,
        image_token_index=cfg.image_token_id,
        pre_process=pre_process,
        post_process=post_process,
        add_encoder=pre_process,
    )
    from megatron.core.transformer.enums import ModelType

    model.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules read
    tower = model.vision_model
    if tower is not None:
        tower.ln_post = None  # HF LLaVA reads the layer outputs, before the tower's post-norm
        tower.kept = KeptTensors(extra_shapes(cfg.vision), dtype)
    return model


def stage_chunk(cfg: LlavaConfig, config, layout: Layout, **kw: Any):
    """This rank's pipeline stage of the LLaVA model (from Megatron's parallel state)."""
    from megatron.core import parallel_state as ps

    return build_llava(
        cfg,
        config,
        layout,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        **kw,
    )


def freeze(
    model: torch.nn.Module, *, vision: bool = False, projector: bool = False, language: bool = False
) -> None:
    """MindSpeed-MM's freeze switches: no gradients (and no optimizer state) for the parts."""
    inner = getattr(model, "module", model)
    inner.freeze(
        freeze_language_model=language,
        freeze_vision_model=vision,
        freeze_vision_projection=projector,
    )
