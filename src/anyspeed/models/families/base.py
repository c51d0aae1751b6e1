"""What a model family is: its HF architecture, its traits in HF configs, its presets and the
declarative HF <-> Megatron tensor-name mapping the converter's shared engine works from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from anyspeed.models.config import ModelConfig


@dataclass(frozen=True)
class Fused:
    """A Megatron tensor the engine builds from several HF tensors (and splits back)."""

    # "qkv" | "gate_up" | "qgkv" (queries with their gates) | "delta_in" (Qwen3-Next's DeltaNet)
    # | "delta_in_flat" (Qwen3.5's) | "qkv_packed" (Q, K, V in one HF tensor: Phi-3's)
    kind: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class ExpertSlice:
    """Expert ``expert``'s part of an HF tensor that stacks every expert of a layer as
    [experts, ...] (GPT-OSS). ``layout``: ``gate_up_t`` ([h, 2f], gate and up columns
    interleaved <-> fc1 [gate; up] as [2f, h]), ``gate_up`` (a [2f] interleaved bias), ``t``
    (transposed: [f, h] <-> [h, f]) or ``same``."""

    name: str
    layout: str
    expert: int = -1  # filled in per expert by the engine


def qkv(pattern: str) -> Fused:
    """Q, K, V projections named by ``pattern`` with ``{}`` for q / k / v."""
    return Fused("qkv", tuple(pattern.format(x) for x in "qkv"))


def gate_up(gate: str, up: str) -> Fused:
    """SwiGLU's gate and up projections, fused as Megatron's ``linear_fc1`` = [gate; up]."""
    return Fused("gate_up", (gate, up))


@dataclass(frozen=True)
class FamilyMapping:
    """Megatron name -> HF name (or :class:`Fused`), for the model top and for one layer."""

    family: str
    top: dict[str, str]
    layer: dict[str, str | Fused]
    hf_layer: str = "model.layers.{i}."
    mg_layer: str = "decoder.layers.{i}."
    # HF tensors that older checkpoints carry and the model recomputes (suffixes).
    ignored_hf: tuple[str, ...] = field(default=("rotary_emb.inv_freq",))
    # A MoE layer: its ``mlp.*`` tensors are ``moe`` (router, shared experts) plus ``expert``
    # once per expert, ``{e}`` standing for the (global) expert index on both sides.
    moe: dict[str, str | Fused] = field(default_factory=dict)
    expert: dict[str, str | Fused | ExpertSlice] = field(default_factory=dict)
    # A multi-token prediction layer (DeepSeek-V3 stores one as the HF layer after the last
    # decoder layer): its own tensors (Megatron name under ``mtp.layers.{j}.`` -> HF name under
    # the layer; the rest are a decoder layer's), and the HF tensors it holds that copy the
    # embedding or the output layer (written on export, read as copies on import).
    mtp: dict[str, str] = field(default_factory=dict)
    mtp_copies: dict[str, str] = field(default_factory=dict)
    # A gated DeltaNet layer (Qwen3-Next): its ``self_attention.*`` tensors, in place of the
    # attention's.
    linear: dict[str, str | Fused] = field(default_factory=dict)

    def extend(
        self,
        family: str,
        layer: dict[str, str | Fused] | None = None,
        **moe: dict[str, str | Fused],
    ) -> FamilyMapping:
        """This mapping under another family name, with extra per-layer tensors (and, as
        ``moe=`` / ``expert=``, the tensors of its MoE layers)."""
        return replace(
            self, family=family, top=dict(self.top), layer={**self.layer, **(layer or {})}, **moe
        )


# Megatron-Core GPTModel (local spec) names <- Hugging Face LLaMA-style names.
LLAMA_MAPPING = FamilyMapping(
    family="llama",
    top={
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",  # absent when the embeddings are tied
    },
    layer={
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_qkv.weight": qkv("self_attn.{}_proj.weight"),
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.weight": gate_up("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    },
)


@dataclass(frozen=True)
class Family:
    """One model family: everything anyspeed knows about it, in one place."""

    name: str  # the HF model_type
    hf_architecture: str  # the HF class (config.json "architectures")
    mapping: FamilyMapping
    presets: tuple[ModelConfig, ...]  # published sizes
    tiny: tuple[ModelConfig, ...]  # the family's traits at a size a CPU trains in seconds
    # MoE families: ModelConfig fields from an HF config.json, and back (see families/moe_hf.py)
    moe_from_hf: Callable[[dict[str, Any], int], dict[str, Any]] | None = None
    moe_to_hf: Callable[[ModelConfig], dict[str, Any]] | None = None
    mla: bool = False  # multi-latent attention: the family's hook reads its rope and heads
    qkv_bias: bool = False  # HF configs of the family imply biases on Q, K, V
    own_rope: bool = False  # the family's moe_from_hf reads its rope (YaRN) itself
    qk_norm: bool = False  # ... RMSNorm on queries and keys
    head_dim_in_config: bool = False  # HF config.json writes head_dim
    attention_bias_key: bool = False  # HF config.json writes attention_bias
    # QKV biases and QK norm are per model (config.json's attention_bias / use_qk_norm), not
    # traits of the family (GLM-4.5 has QK norm, GLM-4.5-Air not)
    attention_traits_in_config: bool = False
    # Dense families with fields of their own: ModelConfig fields from an HF config.json, and
    # the HF config keys back (as moe_from_hf / moe_to_hf for the MoE families)
    dense_from_hf: Callable[[dict[str, Any], int], dict[str, Any]] | None = None
    dense_to_hf: Callable[[ModelConfig], dict[str, Any]] | None = None
    hidden_act: str = "silu"  # the MLP activation config.json names (hidden_act)
    # the layer type whose RoPE is the model's --rotary-base where config.json nests one per
    # type (Gemma 3; the family's hook reads the others)
    rope_layer_type: str | None = None


def every_nth_off(flags: list[bool]) -> str:
    """A per-layer on/off list as Megatron's frequency flags write it: ``N`` when exactly the
    layers numbered 1.. that N divides are off (``--window-attn-skip-freq``,
    ``--linear-attention-freq``), else the list (``[1,1,0,...]``)."""
    for n in range(2, len(flags) + 1):
        if flags == [(i + 1) % n != 0 for i in range(len(flags))]:
            return str(n)
    return "[" + ",".join(str(int(f)) for f in flags) + "]"


def window_skip_freq(layer_types: Any, num_layers: int, family: str) -> str | None:
    """``--window-attn-skip-freq`` for HF's ``layer_types`` (None: every layer windowed)."""
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or not set(layer_types) <= {"sliding_attention", "full_attention"}
    ):
        raise ValueError(f"{family}: config.json layer_types must name each layer's attention")
    windowed = [t == "sliding_attention" for t in layer_types]
    return None if all(windowed) else every_nth_off(windowed)


def tiny(base: ModelConfig, name: str, **changes) -> ModelConfig:
    """``base``'s traits at tiny size: 2 layers, hidden 64, 4 heads, vocabulary 512."""
    size = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=176,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=512,
    )
    return replace(base, name=name, **{**size, **changes})
