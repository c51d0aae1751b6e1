"""Gemma 2's traits on Megatron-Core's own modules, which lack them.

* **Sandwich norms** (``--post-norm``): a norm on the attention's output and one on the MLP's
  output, before each residual add (Gemma 2's ``post_attention_layernorm`` and
  ``post_feedforward_layernorm``). :func:`sandwich_layer` is Megatron's ``TransformerLayer``
  with the two norms as children (``post_attn_norm``, ``post_mlp_layernorm``: MindSpeed-LLM's
  names) applied by forward hooks on ``self_attention`` and ``mlp``, so every path through the
  layer (recompute, chunked prefill, MoE) normalises the same tensor.
* **Soft-capping** ``c * tanh(x / c)``: of the attention scores (``--attn-logit-softcapping``)
  before the mask and the softmax — the core is marked (``logit_softcap``) for anyspeed's
  blocked kernel, and a pre-hook on its ``scale_mask_softmax`` caps Megatron's S x S path
  (level 0, a decode step); of the output logits (``--output-logit-softcapping``) as a hook on
  the output layer.
* **Scaled embeddings** (``--input-embeds-norm``): the embedding's output times sqrt(hidden),
  the factor rounded to the activations' dtype first as transformers does.
* **A RoPE base of the sliding-window layers' own** (Gemma 3, ``--rotary-base-local``): a
  second Megatron ``RotaryEmbedding`` whose table a pre-hook hands the windowed layers in place
  of the model's (same length, so the decode step's slicing holds).

Hooks hold numbers, bound methods or the model's own child modules, so a deep copy of the model
(a reference model) calls its own copies. Each is marked ``replayable``: the lean decode step
(``features/inference``) calls it where the module call it bypasses would.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F

from anyspeed.features.inference.replay import replayable
from anyspeed.models.config import ModelConfig


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


gelu_tanh.elementwise = True  # type: ignore[attr-defined]  # the decode step may call it alone


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: smooth clipping to (-cap, cap)."""
    return torch.tanh(x / cap) * cap


@functools.cache
def sandwich_layer() -> type:
    """Megatron's ``TransformerLayer`` with norms on its attention's and its MLP's outputs."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class SandwichLayer(TransformerLayer):
        """A transformer layer with Gemma 2's post-attention and post-MLP norms."""

        def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, submodules, *args, **kwargs)
            norm = dict(
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )
            self.post_attn_norm = build_module(submodules.input_layernorm, **norm)
            self.post_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm)
            self.self_attention.register_forward_hook(self._norm_attention_output)
            self.mlp.register_forward_hook(self._norm_mlp_output)

        def _norm_attention_output(self, module: Any, args: Any, out: Any) -> Any:
            return (self.post_attn_norm(out[0]), *out[1:])

        def _norm_mlp_output(self, module: Any, args: Any, out: Any) -> Any:
            return (self.post_mlp_layernorm(out[0]), *out[1:])

    replayable(SandwichLayer._norm_attention_output)
    replayable(SandwichLayer._norm_mlp_output)
    return SandwichLayer


def with_post_norms(spec: Any) -> Any:
    """``spec`` (a layer spec, or a block spec of layer specs) with sandwich layers."""
    layer = sandwich_layer()
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(
            spec, layer_specs=[dataclasses.replace(s, module=layer) for s in spec.layer_specs]
        )
    return dataclasses.replace(spec, module=layer)


def _cap_scores(cap: float, module: Any, args: tuple) -> tuple:
    return (softcap(args[0], cap), *args[1:])


def _cap_logits(cap: float, module: Any, args: Any, out: Any) -> Any:
    return (softcap(out[0], cap), *out[1:])


def _scale_embeddings(scale: float, module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * torch.tensor(scale, dtype=out.dtype)


def _local_rope(rope: Any, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    table = kwargs.get("rotary_pos_emb")
    if table is not None:
        kwargs["rotary_pos_emb"] = rope(table.shape[0]).to(table.device)
    return args, kwargs


def _add_local_rope(gpt: Any, model: ModelConfig) -> None:
    """The windowed layers of ``gpt`` rotate by a RoPE of base ``rotary_base_local``."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(
        kv_channels=model.head_dim,
        rotary_percent=model.rotary_percent,
        rotary_base=model.rotary_base_local,
        use_cpu_initialization=True,
    )
    gpt.local_rotary_pos_emb = rope  # no parameters or buffers: nothing in the state dict
    windowed = model.window_layers()
    for layer in gpt.decoder.layers:
        if windowed[layer.layer_number - 1]:
            hook = replayable(functools.partial(_local_rope, rope))
            layer.register_forward_pre_hook(hook, with_kwargs=True)


def add_gemma_hooks(gpt: Any, model: ModelConfig) -> None:
    """Soft-capping, the embedding scale and the windowed layers' RoPE on a built
    ``GPTModel`` (or pipeline chunk)."""
    if model.rotary_base_local is not None and model.rotary_base_local != model.rotary_base:
        _add_local_rope(gpt, model)
    cap = model.attn_logit_softcapping
    if cap:
        for m in gpt.modules():
            if hasattr(m, "scale_mask_softmax") and hasattr(m, "softmax_scale"):
                m.logit_softcap = cap  # read by the blocked kernel's dispatch (ops/attention.py)
                hook = replayable(functools.partial(_cap_scores, cap))
                m.scale_mask_softmax.register_forward_pre_hook(hook)
    head = getattr(gpt, "output_layer", None)
    if model.output_logit_softcapping and gpt.post_process and head is not None:
        cap_logits = functools.partial(_cap_logits, model.output_logit_softcapping)
        head.register_forward_hook(replayable(cap_logits))
    if model.input_embeds_norm and gpt.pre_process:
        gpt.embedding.register_forward_hook(
            functools.partial(_scale_embeddings, math.sqrt(model.hidden_size))
        )


def gemma_config(model: ModelConfig) -> dict[str, Any]:
    """``TransformerConfig`` fields of Gemma 2's traits (the score scale)."""
    if model.query_pre_attn_scalar is None:
        return {}
    return {"softmax_scale": model.query_pre_attn_scalar**-0.5}
