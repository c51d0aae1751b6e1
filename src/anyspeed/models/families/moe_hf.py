"""What the MoE families share: their HF config's expert fields <-> ModelConfig, the dense/MoE
layer pattern both ways, and the tensor names of Qwen-style expert blocks."""

from __future__ import annotations

from typing import Any

from anyspeed.models.config import ModelConfig
from anyspeed.models.families.base import gate_up
from anyspeed.models.patterns import layer_pattern, pattern_text


def int_of(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        value = config.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"config.json {key} is {value!r:.40}, not a whole number")
            return value
    if default is None:
        raise ValueError(f"config.json has no {keys[0]} (an MoE model config needs it)")
    return default


def qwen_moe_from_hf(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen1.5/2/3-MoE: experts in every ``decoder_sparse_step``-th layer except
    ``mlp_only_layers``; ``norm_topk_prob`` false means softmax over all experts, then top-k
    (Megatron's pre-softmax), true means top-k then softmax (Megatron's default)."""
    step = int_of(config, "decoder_sparse_step", default=1)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError("config.json mlp_only_layers is not a list of layer numbers")
    bits = [int(i not in dense and step > 0 and (i + 1) % step == 0) for i in range(num_layers)]
    shared = config.get("shared_expert_intermediate_size") or None
    return dict(
        num_experts=int_of(config, "num_experts", "num_local_experts"),
        moe_router_topk=int_of(config, "num_experts_per_tok"),
        moe_ffn_hidden_size=int_of(config, "moe_intermediate_size"),
        moe_layer_freq=pattern_text(bits),
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=bool(shared),
        moe_router_pre_softmax=not config.get("norm_topk_prob", False),
        moe_aux_loss_coeff=float(config.get("router_aux_loss_coef") or 0.0),
    )


def qwen_moe_to_hf(model: ModelConfig) -> dict[str, Any]:
    """The HF config fields :func:`qwen_moe_from_hf` reads, for ``model``."""
    bits = layer_pattern(model.moe_layer_freq, model.num_layers)
    out = {
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.moe_router_topk,
        "moe_intermediate_size": model.expert_ffn_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, b in enumerate(bits) if not b],
        "norm_topk_prob": not model.moe_router_pre_softmax,
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
    }
    if model.moe_shared_expert_intermediate_size:
        out["shared_expert_intermediate_size"] = model.moe_shared_expert_intermediate_size
    return out


def check_router(model: ModelConfig, family: str, hf_name: str) -> None:
    """ValueError when ``model``'s router has options the family's HF model cannot express."""
    if model.moe_router_score_function != "softmax" or model.moe_router_num_groups:
        raise ValueError(f"{family}: {hf_name} routes by softmax over all experts only")
    if model.moe_router_topk_scaling_factor not in (None, 1.0):
        raise ValueError(f"{family}: {hf_name} has no top-k scaling factor")


QWEN_MOE = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc1.weight": gate_up(
        "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"
    ),
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
QWEN_EXPERT = {
    "mlp.experts.local_experts.{e}.linear_fc1.weight": gate_up(
        "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"
    ),
    "mlp.experts.local_experts.{e}.linear_fc2.weight": "mlp.experts.{e}.down_proj.weight",
}
