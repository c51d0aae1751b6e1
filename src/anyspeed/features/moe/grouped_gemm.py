"""Grouped GEMM for MoE experts on every device: torch's ``grouped_mm`` behind Megatron's seam.

Megatron's ``GroupedMLP`` multiplies each expert's tokens by that expert's weights through the
``grouped_gemm`` package (a CUDA build) and asserts bf16. Here the same product runs through
PyTorch's own grouped matmul, which torch 2.13 provides on CPU and CUDA in fp32/bf16/fp16, with a
per-expert loop for the shapes it refuses (rows must be 16-byte aligned) so no shape fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REFUSED: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) the kernel refused once


def kernel_accepts(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes ``x @ w[e]``: its dtypes and 16-byte row strides."""
    if not hasattr(F, "grouped_mm") or x.dtype not in _KERNEL_DTYPES or w.dtype != x.dtype:
        return False
    size = x.element_size()
    return (x.shape[-1] * size) % 16 == 0 and (w.shape[-1] * size) % 16 == 0


def grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """``x`` [T, K] with rows grouped by expert (``tokens_per_expert`` [E] rows each) times
    ``w`` [E, K, N] -> [T, N]; every expert's weight gets a gradient even with no tokens."""
    if x.shape[0] == 0:
        return x @ w[0]  # an empty product that still connects ``w`` to the graph
    key = (x.device.type, x.dtype)
    if key not in _REFUSED and kernel_accepts(x, w):
        offs = tokens_per_expert.to(device=x.device).cumsum(0).to(torch.int32)
        try:
            out = F.grouped_mm(x.contiguous(), w, offs=offs)
        except RuntimeError:  # e.g. a CUDA build whose kernel needs a newer GPU or dtype
            _REFUSED.add(key)
        else:
            if out.requires_grad:  # the kernel's backward refuses expanded (stride-0) gradients
                out.register_hook(lambda g: g.contiguous())
            return out
    counts = [int(c) for c in tokens_per_expert.tolist()]
    # unbind: one backward node for all experts (indexing w[i] per expert would build E
    # full-size zero gradients, 20x slower at 64 experts)
    parts = zip(torch.split(x, counts), w.unbind(0), strict=True)
    return torch.cat([part @ we for part, we in parts])


def grouped_gemm_available() -> bool:
    """Stands in for Megatron's check of the CUDA ``grouped_gemm`` package."""
    return True


def grouped_mlp_forward(
    self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor
) -> tuple[torch.Tensor, None]:
    """``GroupedMLP.forward`` in any dtype: fc1, the activation scaled by the routing
    probabilities (recomputed in backward under ``moe_act`` recompute), fc2."""
    from megatron.core import tensor_parallel

    cfg = self.config
    if cfg.moe_apply_probs_on_input:  # top-1 routing may scale the input instead of the output
        hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
        probs = torch.ones_like(probs)
    experts, h = self.num_local_experts, cfg.hidden_size
    w1 = self.weight1.view(experts, h, -1)
    w2 = self.weight2.view(experts, -1, h)
    lora = getattr(self, "lora_adapters", None)  # LoRA on the experts (training/lora_experts)

    def fc2(x: torch.Tensor) -> torch.Tensor:
        out = grouped_matmul(x, w2, tokens_per_expert)
        return (
            out
            if lora is None
            else lora.add("linear_fc2", out, x, tokens_per_expert, grouped_matmul)
        )

    fc1 = grouped_matmul(hidden, w1, tokens_per_expert)
    if lora is not None:
        fc1 = lora.add("linear_fc1", fc1, hidden, tokens_per_expert, grouped_matmul)
    scale = probs.unsqueeze(-1)
    activation = self.activation_func_with_probs
    if cfg.bias_activation_fusion and cfg.gated_linear_unit and cfg.activation_func is F.silu:
        # fused-swiglu (level 1) is on: the SwiGLU that keeps only its input, as the
        # sequential experts' MLPs get through Megatron's fused entry point
        from anyspeed.features.ops.swiglu import weighted_bias_swiglu

        def activation(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return weighted_bias_swiglu(x, None, w)

    if not self.activation_recompute:
        return fc2(activation(fc1, scale)), None
    ckpt = tensor_parallel.CheckpointWithoutOutput()
    act = ckpt.checkpoint(activation, fc1, scale)
    out = fc2(act)  # the adapters' product reads ``act`` too: recomputed before either
    ckpt.discard_output_and_register_recompute(out)
    return out, None
