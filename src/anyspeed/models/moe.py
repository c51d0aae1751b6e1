"""MoE settings of the model type: Megatron's ``--moe-layer-freq`` pattern, and the checks that
name a flag before anything is built (a bad combination is otherwise an assertion in every rank)."""

from __future__ import annotations

from typing import Any


def check_moe(model: Any) -> None:
    """ValueError (one line, naming the flag) when ``model``'s MoE settings cannot build."""
    if not model.is_moe:
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


def layer_pattern(freq: str | int, num_layers: int, flag: str = "--moe-layer-freq") -> list[int]:
    """Megatron's ``--moe-layer-freq``: ``N`` (every N-th layer is MoE, from the first) or a
    list expression such as ``([0]*1+[1]*3)``, read without ``eval``; 1 marks a MoE layer."""
    text = str(freq).replace(" ", "")
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"{flag} must be >= 1 (got {n})")
        return [1 if i % n == 0 else 0 for i in range(num_layers)]
    body = text[1:-1] if text.startswith("(") and text.endswith(")") else text
    pattern: list[int] = []
    for term in body.split("+"):
        values, _, times = term.partition("*")
        if not (values.startswith("[") and values.endswith("]")) or (times and not times.isdigit()):
            raise ValueError(f"{flag}: cannot read {freq!r} (e.g. 2 or '[0]*1+[1]*3')")
        items = [v for v in values[1:-1].split(",") if v]
        if any(v not in ("0", "1") for v in items):
            raise ValueError(f"{flag}: entries must be 0 or 1 (got {freq!r})")
        pattern += [int(v) for v in items] * int(times or 1)
    if len(pattern) != num_layers:
        raise ValueError(
            f"{flag} {freq!r} describes {len(pattern)} layers; --num-layers is {num_layers}"
        )
    return pattern
