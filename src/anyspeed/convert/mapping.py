"""Declarative HF <-> Megatron name mappings, one short block per model family.

A mapping names, for the top of the model and for one decoder layer, which Hugging Face tensor
each Megatron-Core GPTModel (local spec, TP1/PP1) tensor comes from. A plain string is a renamed
tensor; :func:`qkv` and :func:`gate_up` name the tensors the engine fuses (Megatron's
per-query-group interleaved QKV, and SwiGLU's [gate; up]). Adding a family is writing a mapping
here and listing its HF architecture in :data:`anyspeed.models.presets.HF_ARCHITECTURES`; the
tensor work is the shared engine's (:mod:`anyspeed.convert.engine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Fused:
    """A Megatron tensor the engine builds from several HF tensors (and splits back)."""

    kind: str  # "qkv" | "gate_up"
    parts: tuple[str, ...]


def qkv(pattern: str) -> Fused:
    """Q, K, V projections named by ``pattern`` with ``{}`` for q / k / v."""
    return Fused("qkv", tuple(pattern.format(x) for x in "qkv"))


def gate_up(gate: str, up: str) -> Fused:
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

    def extend(self, family: str, layer: dict[str, str | Fused] | None = None) -> FamilyMapping:
        """This mapping under another family name, with extra per-layer tensors."""
        return FamilyMapping(
            family,
            dict(self.top),
            {**self.layer, **(layer or {})},
            self.hf_layer,
            self.mg_layer,
            self.ignored_hf,
        )


LLAMA = FamilyMapping(
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
MISTRAL = LLAMA.extend("mistral")
QWEN2 = LLAMA.extend("qwen2", {"self_attention.linear_qkv.bias": qkv("self_attn.{}_proj.bias")})
QWEN3 = LLAMA.extend(
    "qwen3",
    {
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    },
)

MAPPINGS: dict[str, FamilyMapping] = {m.family: m for m in (LLAMA, MISTRAL, QWEN2, QWEN3)}


def mapping_for(family: str) -> FamilyMapping:
    if family not in MAPPINGS:
        raise ValueError(
            f"no conversion mapping for family {family!r} (have {', '.join(sorted(MAPPINGS))})"
        )
    return MAPPINGS[family]
