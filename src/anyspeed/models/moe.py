"""MoE settings of the model type: the checks that name a flag before anything is built (a bad
combination is otherwise an assertion in every rank); the layer pattern is :mod:`.patterns`."""

from __future__ import annotations

from typing import Any


def check_moe(model: Any) -> None:
    """ValueError (one line, naming the flag) when ``model``'s MoE settings cannot build, or
    are given for a model without experts (they would be ignored)."""
    if not model.is_moe:
        if model.moe_grouped_gemm:
            raise ValueError("--moe-grouped-gemm needs a MoE model: add --num-experts")
        return
    model.moe_layers()  # the --moe-layer-freq pattern fits --num-layers
    if model.add_bias_linear and model.moe_grouped_gemm:  # GroupedMLP has no biases
        raise ValueError("--moe-grouped-gemm experts have no biases: add --disable-bias-linear")
    e, k = model.num_experts or 0, model.moe_router_topk
    if k > e:
        raise ValueError(f"--moe-router-topk {k} exceeds --num-experts {e}")
    groups, group_topk = model.moe_router_num_groups, model.moe_router_group_topk
    if (groups or group_topk) and (
        not (groups and group_topk) or e % groups or group_topk > groups
    ):
        raise ValueError(
            "--moe-router-num-groups must divide --num-experts and --moe-router-group-topk "
            "must be <= it (both are needed)"
        )
    if model.moe_router_enable_expert_bias and model.moe_router_score_function != "sigmoid":
        raise ValueError(
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"
        )
    capacity = model.moe_expert_capacity_factor
    if capacity is not None and model.moe_router_load_balancing_type == "sinkhorn":
        raise ValueError("--moe-expert-capacity-factor does not work with sinkhorn routing")
    if model.moe_pad_expert_input_to_capacity and capacity is None:
        raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if model.moe_shared_expert_gate and not model.moe_shared_expert_intermediate_size:
        raise ValueError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
