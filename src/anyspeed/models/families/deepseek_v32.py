"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3 with sparse attention (DSA). Each
layer's lightning indexer picks the ``index_topk`` keys every query attends to
(:mod:`anyspeed.models.dsa`). Queries are always low-rank, and the rotary channels are always
interleaved."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families import deepseek_v3
from anyspeed.models.families.base import Family
from anyspeed.models.families.moe_hf import int_of

_INDEXER = "self_attention.core_attention.indexer."
_HF_INDEXER = "self_attn.indexer."

# DeepSeek-V3.2-Exp and DeepSeek-V3.2: DeepSeek-V3's sizes with a 64-head indexer picking 2048 keys
PRESETS = (
    replace(
        deepseek_v3.PRESETS[0],
        name="deepseek-v3.2",
        family="deepseek_v32",
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=64,
        dsa_indexer_head_dim=128,
        dsa_indexer_topk=2048,
    ),
)


def _from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if not config.get("q_lora_rank"):
        raise ValueError(
            "deepseek_v32: config.json must set q_lora_rank (its queries are low-rank)"
        )
    return dict(
        deepseek_v3.FAMILY.moe_from_hf(config, num_layers),
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=int_of(config, "index_n_heads", default=64),
        dsa_indexer_head_dim=int_of(config, "index_head_dim", default=128),
        dsa_indexer_topk=int_of(config, "index_topk", default=2048),
    )


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    if model.experimental_attention_variant != "dsa" or not model.q_lora_rank:
        raise ValueError(
            "deepseek_v32: DeepseekV32ForCausalLM has sparse attention (--experimental-attention-"
            "variant dsa) and low-rank queries (--q-lora-rank)"
        )
    out = deepseek_v3.FAMILY.moe_to_hf(model)
    out.pop("rope_interleave", None)
    out.update(
        index_n_heads=model.dsa_indexer_n_heads,
        index_head_dim=model.dsa_indexer_head_dim,
        index_topk=model.dsa_indexer_topk,
    )
    return out


MAPPING = deepseek_v3.MAPPING.extend(
    "deepseek_v32",
    layer={
        _INDEXER + "linear_wq_b.weight": _HF_INDEXER + "wq_b.weight",
        _INDEXER + "linear_wk.weight": _HF_INDEXER + "wk.weight",
        _INDEXER + "k_norm.weight": _HF_INDEXER + "k_norm.weight",
        _INDEXER + "k_norm.bias": _HF_INDEXER + "k_norm.bias",
        _INDEXER + "linear_weights_proj.weight": _HF_INDEXER + "weights_proj.weight",
    },
)

FAMILY = Family(
    name="deepseek_v32",
    hf_architecture="DeepseekV32ForCausalLM",
    mapping=MAPPING,
    presets=PRESETS,
    tiny=(  # tiny-deepseek-v3's sizes; sequences of the tests are longer than 6 keys
        replace(
            deepseek_v3.FAMILY.tiny[0],
            name="tiny-deepseek-v3.2",
            family="deepseek_v32",
            mtp_num_layers=None,
            experimental_attention_variant="dsa",
            dsa_indexer_n_heads=8,
            dsa_indexer_head_dim=16,
            dsa_indexer_topk=6,
        ),
    ),
    moe_from_hf=_from_hf,
    moe_to_hf=_to_hf,
    mla=True,
    qk_norm=True,
)
