"""Rank functions for the MoE tests (spawned, so importable by name)."""

from __future__ import annotations

import torch


def _init_single_rank() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    dist.init_process_group("gloo")
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def _moe_layer(model, grouped: bool):
    """Megatron's MoE layer for ``model``'s first layer, built through anyspeed's builder."""
    from megatron.core.transformer.spec_utils import build_module

    from anyspeed.models import gpt

    config = gpt.transformer_config(model.replace(moe_grouped_gemm=grouped))
    spec = gpt.layer_spec(model.replace(moe_grouped_gemm=grouped), config)
    return build_module(spec.layer_specs[0].submodules.mlp, config=config, layer_number=1)


def _copy_experts(layer, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """HF's fused expert tensors ([E, 2F, H] gate-then-up, [E, H, F]) into Megatron's experts."""
    experts = layer.experts
    with torch.no_grad():
        if hasattr(experts, "weight1"):  # GroupedMLP: its memory is E blocks of fc1.T / fc2.T
            experts.weight1.copy_(gate_up.transpose(1, 2).contiguous().view_as(experts.weight1))
            experts.weight2.copy_(down.transpose(1, 2).contiguous().view_as(experts.weight2))
        else:
            for e, mlp in enumerate(experts.local_experts):
                mlp.linear_fc1.weight.copy_(gate_up[e])
                mlp.linear_fc2.weight.copy_(down[e])


def _hf_block(family: str):
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from anyspeed.models.config import ModelConfig

    torch.manual_seed(0)
    base = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=48, num_experts=4)
    if family == "mixtral":
        cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=4,
                            num_experts_per_tok=2)  # fmt: skip
        return MixtralSparseMoeBlock(cfg), base
    cfg = Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2, shared_expert_intermediate_size=48,
                         norm_topk_prob=False)  # fmt: skip
    model = base.replace(moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=48,
                         moe_shared_expert_gate=True, moe_router_pre_softmax=True)  # fmt: skip
    return Qwen2MoeSparseMoeBlock(cfg), model


def moe_layer_vs_hf_all() -> dict:
    """Every (family, grouped) case of :func:`moe_layer_vs_hf` in one process, and the
    capacity-factor case of :func:`capacity_vs_reference`."""
    _init_single_rank()
    out = {
        (family, grouped): moe_layer_vs_hf(family, grouped)
        for family in ("mixtral", "qwen2_moe")
        for grouped in (False, True)
    }
    out["capacity"] = capacity_vs_reference()
    out["expert_bias"] = expert_bias_vs_reference()
    return out


def expert_bias_vs_reference() -> dict:
    """Sigmoid scores with ``--moe-router-enable-expert-bias`` (aux-loss-free balancing), in
    training mode: the bias moves the top-k choice but not the weights (normalised sigmoid
    scores of the chosen experts), and the layer counts the tokens each expert got for the bias
    update. Against plain torch on the same weights and bias."""
    import torch.nn.functional as F

    from anyspeed.models.config import ModelConfig

    model = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=48, num_experts=4,
                        moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True)  # fmt: skip
    layer = _moe_layer(model, grouped=False).train()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.3, 0.0, 0.1]))
    x = torch.randn(10, 2, 32, generator=g, requires_grad=True)
    out, _ = layer(x)
    out.sum().backward()
    tokens = x.detach().reshape(-1, 32)
    scores = torch.sigmoid(tokens @ layer.router.weight.detach().T)
    chosen = (scores + layer.router.expert_bias).topk(2, dim=-1).indices
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True)
    ref = torch.zeros_like(tokens)
    for e, mlp in enumerate(layer.experts.local_experts):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        gate, up = F.linear(tokens[rows], mlp.linear_fc1.weight.detach()).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, mlp.linear_fc2.weight.detach())
        ref[rows] += weights[rows, slot, None] * y
    counts = torch.bincount(chosen.flatten(), minlength=4).float()
    without_bias = scores.topk(2, dim=-1).indices
    from megatron.core.transformer.moe.router import TopKRouter

    compiled = hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable")
    return {"diff": (out.detach().reshape(-1, 32) - ref).abs().max().item(), "eager": not compiled,
            "counts": layer.router.local_tokens_per_expert.tolist(), "want": counts.tolist(),
            "bias_moved_choice": not torch.equal(chosen.sort(-1).values,
                                                 without_bias.sort(-1).values)}  # fmt: skip


def capacity_vs_reference(factor: float = 0.5) -> dict:
    """Token dropping (``--moe-expert-capacity-factor``, drop policy ``probs``): Megatron's
    layer against plain torch that keeps, per expert, the ``ceil(T*k/E*factor)`` routed tokens
    with the highest routing probability."""
    import math

    import torch.nn.functional as F

    from anyspeed.models.config import ModelConfig

    model = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=48, num_experts=4,
                        moe_expert_capacity_factor=factor)  # fmt: skip
    layer = _moe_layer(model, grouped=False)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    x = torch.randn(10, 2, 32, generator=g)  # [s, b, h]: 20 tokens
    out, _ = layer(x)
    tokens, k, experts = x.reshape(-1, 32), 2, 4
    top_v, top_i = (tokens @ layer.router.weight.T).topk(k, dim=-1)
    probs = torch.zeros(20, experts).scatter(1, top_i, torch.softmax(top_v, dim=-1))
    cap = math.ceil(20 * k / experts * factor)
    ref = torch.zeros_like(tokens)
    kept = 0
    for e, mlp in enumerate(layer.experts.local_experts):
        keep = probs[:, e].topk(cap).indices
        keep = keep[probs[keep, e] > 0]
        kept += len(keep)
        gate, up = F.linear(tokens[keep], mlp.linear_fc1.weight).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, mlp.linear_fc2.weight)
        ref[keep] += probs[keep, e, None] * y
    return {"diff": (out.reshape(-1, 32) - ref).abs().max().item(), "kept": kept,
            "routed": 20 * k, "cap": cap}  # fmt: skip


def moe_layer_vs_hf(family: str, grouped: bool) -> dict:
    """Max-abs differences of outputs and input gradients: Megatron's MoE layer vs HF's block."""
    hf, model = _hf_block(family)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # standalone HF modules are not initialised (post_init does that)
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    layer = _moe_layer(model, grouped)
    with torch.no_grad():
        layer.router.weight.copy_(hf.gate.weight)
        _copy_experts(layer, hf.experts.gate_up_proj, hf.experts.down_proj)
        if family == "qwen2_moe":
            shared = layer.shared_experts
            s = hf.shared_expert
            shared.linear_fc1.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
            shared.linear_fc2.weight.copy_(s.down_proj.weight)
            shared.gate_weight.copy_(hf.shared_expert_gate.weight)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))  # [b, s, h]
    g = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2))
    x_hf = x.clone().requires_grad_()
    out_hf = hf(x_hf)
    out_hf.backward(g)
    x_mg = x.transpose(0, 1).contiguous().requires_grad_()  # Megatron: [s, b, h]
    out_mg, _ = layer(x_mg)
    out_mg.backward(g.transpose(0, 1))
    return {
        "out": (out_mg.transpose(0, 1) - out_hf).abs().max().item(),
        "grad": (x_mg.grad.transpose(0, 1) - x_hf.grad).abs().max().item(),
        "experts": type(layer.experts).__name__,
    }
