"""Mixtral: the Mistral layout with a top-2 of 8 SwiGLU experts in every layer (router: top-k,
then softmax over the chosen, Megatron's default)."""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import LLAMA_MAPPING, Family, gate_up, tiny
from anyspeed.models.families.moe_hf import check_router, int_of

PRESETS = (
    ModelConfig(
        "mixtral-8x7b",
        "mixtral",
        32,
        4096,
        14336,
        32,
        8,
        32000,
        32768,
        1000000.0,
        1e-5,
        num_experts=8,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.02,
    ),
)


def _from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    return dict(
        num_experts=int_of(config, "num_local_experts"),
        moe_router_topk=int_of(config, "num_experts_per_tok"),
        moe_ffn_hidden_size=int_of(config, "intermediate_size"),
        moe_aux_loss_coeff=float(config.get("router_aux_loss_coef") or 0.0),
    )


def _to_hf(model: ModelConfig) -> dict[str, Any]:
    check_router(model, "mixtral", "MixtralForCausalLM")
    if model.moe_router_pre_softmax or model.moe_shared_expert_intermediate_size:
        raise ValueError("mixtral: MixtralForCausalLM has no pre-softmax routing or shared expert")
    if not all(model.moe_layers()):
        raise ValueError("mixtral: MixtralForCausalLM has experts in every layer")
    return {
        "num_local_experts": model.num_experts,
        "num_experts_per_tok": model.moe_router_topk,
        "intermediate_size": model.expert_ffn_size,
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
    }


_MOE = "block_sparse_moe."
FAMILY = Family(
    name="mixtral",
    hf_architecture="MixtralForCausalLM",
    mapping=LLAMA_MAPPING.extend(
        "mixtral",
        moe={"mlp.router.weight": _MOE + "gate.weight"},
        expert={
            "mlp.experts.local_experts.{e}.linear_fc1.weight": gate_up(
                _MOE + "experts.{e}.w1.weight", _MOE + "experts.{e}.w3.weight"
            ),
            "mlp.experts.local_experts.{e}.linear_fc2.weight": _MOE + "experts.{e}.w2.weight",
        },
    ),
    presets=PRESETS,
    tiny=(tiny(PRESETS[0], "tiny-mixtral", ffn_hidden_size=32, moe_ffn_hidden_size=32),),
    moe_from_hf=_from_hf,
    moe_to_hf=_to_hf,
    head_dim_in_config=True,
)
