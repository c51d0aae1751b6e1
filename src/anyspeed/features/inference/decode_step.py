"""A one-token decode step of a Megatron ``GPTModel`` through its own weights and static KV
cache, without its per-module Python.

Decoding one token runs ~17 small matmuls per step; Megatron's layer, attention, MLP and
bias-dropout-add modules around them cost as much Python per step as the math of a small model.
For the common layer (pre-norm, RoPE, GQA self-attention with optional qk-norm, gated or plain
MLP) this step does the same tensor math straight from the module parameters, writes the new
key/value into Megatron's ``StaticInferenceContext`` (keys rotated when stored, as
``no-grad-fast-path`` stores them) and calls the embedding, norm and output modules as they
are; a MoE block and multi-latent attention are called as their own modules (the layer around
them still runs here). Sliding windows (per layer, as the attention core holds them) and
GPT-OSS's sinks are applied here, YaRN's and LongRoPE's tables and attention factors taken as
Megatron's forward takes them; hooks on the bypassed modules that :mod:`.replay` knows (Gemma's
sandwich norms, capped scores and logits, its windowed layers' RoPE) are called where the
modules would run them. Pipeline stages run their own layers (the schedule moves the hidden
states). Anything else (learned positions, interleaved RoPE, gated attention, multi-token
prediction, other hooks, ...) returns None and Megatron's forward runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from anyspeed.features.inference import replay
from anyspeed.features.inference.attend import attend
from anyspeed.features.inference.packed import PackedWeights
from anyspeed.features.inference.packed import of as packed_of

_PLAN = "_anyspeed_decode_plan"
# device types whose static cache :func:`allocate_cache` lays out in the step's order (measured
# faster on a CPU; ``benchmarks/generate.py`` times the other order on the device it runs on)
STEP_ORDER_DEVICES = frozenset({"cpu"})
# TransformerConfig fields whose non-default value changes the layer's math beyond this step
_PLAIN = {
    "flash_decode": False,
    "fp32_residual_connection": False,
    "apply_residual_connection_post_layernorm": False,
    "sequence_parallel": False,
    "apply_query_key_layer_scaling": False,
    "attention_output_gate": False,
    "qk_l2_norm": False,
    "no_rope_freq": None,
    "experimental_attention_variant": None,
    "mtp_num_layers": None,
    "use_te_activation_func": False,
    "context_parallel_size": 1,
    "inference_fuse_tp_communication": False,
}


@dataclass
class _Layer:
    number: int
    norm1: Any
    qkv: tuple[torch.Tensor, torch.Tensor | None] | None  # None: call ``attention`` (MLA)
    q_norm: Any
    k_norm: Any
    proj: tuple[torch.Tensor, torch.Tensor | None] | None
    norm2: Any
    fc1: tuple[torch.Tensor, torch.Tensor | None] | None  # None: call ``mlp`` (MoE)
    fc2: tuple[torch.Tensor, torch.Tensor | None] | None
    mlp: Any
    attention: Any = None
    module: Any = None  # the layer (its pre-hooks may hand it another rotary table)
    window: int | None = None  # keys before the new one it sees (None: all)
    sink: torch.Tensor | None = None  # per head: a logit for "none of the keys" (GPT-OSS)
    softmax: Any = None  # the attention core's softmax (its pre-hooks see the scores)


@dataclass
class _Plan:
    layers: list[_Layer]
    groups: int  # query groups on this TP rank
    per_group: int  # query heads per group
    dim: int
    scale: float
    mscale: float  # cos and sin times this (YaRN's, LongRoPE's attention factor)
    gated: bool
    act: Any
    tp_group: Any  # None at TP1
    softmax_fp32: bool


def _wb(linear: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = getattr(linear, "bias", None)
    return linear.weight, bias if isinstance(bias, torch.Tensor) and bias.numel() else None


def _norm_or_none(norm: Any) -> Any:
    """A qk-norm module; None for none (Megatron's specs put an ``IdentityOp`` there)."""
    from megatron.core.transformer.identity_op import IdentityOp

    return None if norm is None or isinstance(norm, IdentityOp) else norm


def _layer(layer: Any) -> _Layer | None:
    """The weights and norm modules of one layer whose attention is plain (or multi-latent,
    then called as its module) and whose MLP is plain (or a MoE block); None otherwise."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    attn = getattr(layer, "self_attention", None)
    latent = isinstance(attn, MLASelfAttention)
    if not latent and (
        attn is None or not hasattr(attn, "linear_qkv") or not hasattr(attn, "linear_proj")
    ):
        return None
    if not latent and attn.config.num_query_groups < attn.world_size:  # KV heads replicated
        return None
    if not isinstance(getattr(layer, "cross_attention", IdentityOp()), IdentityOp):
        return None
    norms = (layer.input_layernorm, layer.pre_mlp_layernorm)
    if any(isinstance(n, IdentityOp) for n in norms):  # a norm fused into the next linear
        return None
    dense = type(layer.mlp) is MLP
    cfg = layer.mlp.config
    act = cfg.activation_func
    plain_act = act in (torch.nn.functional.silu, torch.nn.functional.gelu)
    if dense and not (plain_act or getattr(act, "elementwise", False)):
        return None
    if dense and (cfg.glu_linear_offset or cfg.activation_func_clamp_value is not None):
        return None  # GPT-OSS's GLU (its experts are MoE blocks, called as modules)
    softmax = None if latent else getattr(attn.core_attention, "scale_mask_softmax", None)
    window = getattr(softmax, "window_size", None)
    if window is not None and window[1] != 0:
        return None
    return _Layer(
        number=attn.layer_number,
        norm1=norms[0],
        qkv=None if latent else _wb(attn.linear_qkv),
        q_norm=None if latent else _norm_or_none(attn.q_layernorm),
        k_norm=None if latent else _norm_or_none(attn.k_layernorm),
        proj=None if latent else _wb(attn.linear_proj),
        norm2=norms[1],
        fc1=_wb(layer.mlp.linear_fc1) if dense else None,
        fc2=_wb(layer.mlp.linear_fc2) if dense else None,
        mlp=None if dense else layer.mlp,
        attention=attn if latent else None,
        module=layer,
        window=None if window is None else window[0],
        softmax=softmax,
        sink=None if latent else getattr(attn.core_attention, "softmax_offset", None),
    )


def _build(model: Any) -> _Plan | None:
    """What the step needs from ``model``, or None when a layer is not of a kind it runs."""
    config = model.config
    if getattr(model, "mtp_process", False):
        return None
    if model.position_embedding_type not in ("rope", "yarn"):
        return None
    if any(getattr(config, k, v) != v for k, v in _PLAIN.items()):
        return None
    if model.post_process and not replay.head_replayable(model.output_layer):
        return None
    if not all(replay.replayable_layer(layer) for layer in model.decoder.layers):
        return None  # e.g. LoRA adapters: hooks the bypassed modules' calls would run
    layers = [_layer(layer) for layer in model.decoder.layers]
    if not layers or any(x is None for x in layers):
        return None
    plain = [
        m.self_attention
        for m, x in zip(model.decoder.layers, layers, strict=True)
        if x.attention is None
    ]
    mscale = 1.0
    if plain:  # RoPE applied here: the kinds no-grad-fast-path stores rotated
        from megatron.core.transformer import attention

        mscale = attention._yarn_get_concentration_factor_from_config(config)
        if config.multi_latent_attention or config.rotary_interleaved:
            return None
    attn = plain[0] if plain else None
    dim = attn.hidden_size_per_attention_head if attn else 1
    groups = attn.num_query_groups_per_partition if attn else 1
    tp = model.decoder.layers[0].self_attention.pg_collection.tp
    return _Plan(
        layers=layers,
        groups=groups,
        per_group=attn.num_attention_heads_per_partition // groups if attn else 1,
        dim=dim,
        scale=config.softmax_scale or 1.0 / math.sqrt(dim),
        mscale=mscale,
        gated=config.gated_linear_unit,
        act=config.activation_func,
        tp_group=tp if tp.size() > 1 else None,
        softmax_fp32=config.attention_softmax_in_fp32,
    )


def plan_of(model: Any) -> _Plan | None:
    """The model's decode plan, built once (False is cached as "not supported")."""
    plan = model.__dict__.get(_PLAN)
    if plan is None:
        plan = _build(model) or False
        model.__dict__[_PLAN] = plan
    return plan or None


def allocate_cache(model: Any, ctx: Any) -> None:
    """Allocate the static KV cache of the layers :func:`decode_step` attends through, before
    Megatron's first forward would: the same ``[seq, batch, groups, dim]`` tensors Megatron
    indexes, but laid out ``[batch, groups, seq, dim]`` in memory, so each row's keys of one
    group are contiguous for the step's batched products (Megatron's own order puts a whole
    batch between two slots of a row). On a CPU at batch 64 whole runs took 3.4% less time; on
    other devices, not measured yet, Megatron's order stays."""
    plan = plan_of(model)
    plain = [lay for lay in plan.layers if lay.qkv is not None] if plan is not None else []
    if not plain or plain[0].qkv[0].device.type not in STEP_ORDER_DEVICES:
        return
    batch, seq = ctx.max_batch_size, ctx.max_sequence_length
    for lay in plain:
        if lay.number in ctx.key_value_memory_dict:
            continue
        w = lay.qkv[0]
        shape = (batch, plan.groups, seq, plan.dim)
        ctx.key_value_memory_dict[lay.number] = tuple(
            torch.empty(shape, dtype=w.dtype, device=w.device).permute(2, 0, 1, 3) for _ in range(2)
        )


def _linear(
    x: torch.Tensor,
    wb: tuple[torch.Tensor, torch.Tensor | None],
    packs: PackedWeights | None,
    group: Any = None,
) -> torch.Tensor:
    """``x @ w.T`` (summed over the TP ``group`` for a row-parallel weight) ``+ b``; through
    the weight's packed copy when the model has ``packs``."""
    if packs is not None and group is None:
        return packs.linear(x, *wb)
    out = torch.matmul(x, wb[0].t()) if packs is None else packs.linear(x, wb[0], None)
    if group is not None:
        torch.distributed.all_reduce(out, group=group)
    return out if wb[1] is None else out + wb[1]


def _attention(
    plan: _Plan,
    lay: _Layer,
    h: torch.Tensor,
    ctx: Any,
    rope: tuple,
    mask: torch.Tensor | None,
    packs: PackedWeights | None = None,
) -> torch.Tensor:
    """Self-attention of one new token per row [1, b, hidden] through the static cache."""
    from anyspeed.features.ops.rope import rotate

    if lay.attention is not None:  # multi-latent attention: its own module and cache layout
        out, bias = lay.attention(h, attention_mask=mask, inference_context=ctx)
        return out if bias is None else out + bias

    b, g, p, d = h.shape[1], plan.groups, plan.per_group, plan.dim
    qkv = _linear(h, lay.qkv, packs).view(1, b, g, p + 2, d)  # each group: p queries, k, v
    v = qkv[:, :, :, p + 1]
    if lay.q_norm is None and lay.k_norm is None:  # one rotation for the queries and the key
        qk = rotate(qkv[:, :, :, : p + 1], *rope)
        q, k = qk[:, :, :, :p], qk[:, :, :, p]
    else:
        q, k = qkv[:, :, :, :p].reshape(1, b, g * p, d), qkv[:, :, :, p]
        if lay.q_norm is not None:
            q = lay.q_norm(q)
        if lay.k_norm is not None:
            k = lay.k_norm(k)
        q, k = rotate(q, *rope).view(1, b, g, p, d), rotate(k, *rope)
    keys, values = ctx.key_value_memory_dict[lay.number]
    start, rows = ctx.sequence_len_offset, slice(ctx.batch_size_offset, ctx.batch_size_offset + b)
    keys[start, rows] = k[0]
    values[start, rows] = v[0]
    if lay.window is not None and start > lay.window:  # slots before the window: hidden
        early = torch.arange(start + 1, device=h.device) < start - lay.window
        mask = early.view(1, 1, 1, -1) if mask is None else mask[..., : start + 1] | early
    kv = keys[: start + 1, rows], values[: start + 1, rows]
    out = attend(q[0], *kv, mask, plan.scale, plan.softmax_fp32, lay.softmax, lay.sink)
    out = _linear(out[None], lay.proj, packs, plan.tp_group)
    return replay.outputs(lay.module.self_attention, (h,), out)  # e.g. Gemma's sandwich norm


def _mlp(
    plan: _Plan, lay: _Layer, h: torch.Tensor, packs: PackedWeights | None = None
) -> torch.Tensor:
    if lay.fc1 is None:  # a MoE block: its own module
        out, bias = lay.mlp(h)
        return out if bias is None else out + bias
    y = _linear(h, lay.fc1, packs)
    if plan.gated:
        gate, up = y.chunk(2, dim=-1)
        y = plan.act(gate) * up
    else:
        y = plan.act(y)
    return replay.outputs(lay.module.mlp, (h,), _linear(y, lay.fc2, packs, plan.tp_group))


def decode_step(
    model: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    ctx: Any,
) -> torch.Tensor | None:
    """Logits [b, 1, vocab] (gathered over TP) of one new token per row (a stage before the
    last returns its hidden states, as Megatron's forward does), the cache advanced as
    Megatron's forward would; None when this model or call needs Megatron's forward."""
    plan = plan_of(model)
    if plan is None or input_ids.shape[1] != 1:
        return None
    if any(lay.number not in ctx.key_value_memory_dict for lay in plan.layers):
        return None  # no prefill through Megatron yet: it allocates the cache
    if model.pre_process:
        x = model.embedding(input_ids=input_ids, position_ids=position_ids)  # [1, b, hidden]
    else:  # a later pipeline stage: the previous stage's output, set by the schedule
        x = model.decoder.input_tensor
        if x is None:
            return None
    rope = None
    if any(lay.attention is None for lay in plan.layers):
        from anyspeed.features.ops.rope import cached_signed_tables

        # the rotary table Megatron's forward would take (the static cache's length; LongRoPE:
        # the slots so far), rotation by slot; YaRN's module also returns its mscale
        rotary = model.rotary_pos_emb
        emb = rotary(rotary.get_rotary_seq_len(ctx, model.decoder, x, model.config, None))
        emb = emb[0] if isinstance(emb, tuple) else emb
        start = ctx.sequence_len_offset

        def rope_at(table: torch.Tensor) -> tuple:
            cos, sin = cached_signed_tables(table, x.dtype, plan.mscale)
            return cos[start : start + 1], sin[start : start + 1]

        rope = rope_at(emb)
    mask = attention_mask  # [b, 1, 1, keys]: one query per row
    packs = packed_of(model)
    for lay in plan.layers:
        own = rope  # a layer's pre-hooks may hand it its own table (Gemma 3's windowed layers)
        if rope is not None and lay.module._forward_pre_hooks:
            own = rope_at(replay.layer_rope(lay.module, emb))
        x = x + _attention(plan, lay, lay.norm1(x), ctx, own, mask, packs)
        x = x + _mlp(plan, lay, lay.norm2(x), packs)
    if model.decoder.final_layernorm is not None:
        x = model.decoder.final_layernorm(x)
    if not model.post_process:
        return x  # hidden states [1, b, hidden] for the next pipeline stage
    weight = (
        model.shared_embedding_or_output_weight()
        if (model.share_embeddings_and_output_weights)
        else None
    )
    if packs is not None and plan.tp_group is None:  # the whole vocabulary on this rank
        head = model.output_layer
        logits = packs.linear(x, head.weight if weight is None else weight, _wb(head)[1])
        logits = replay.outputs(head, (x,), logits)  # e.g. Gemma 2's soft-capped logits
    else:
        logits, _ = model.output_layer(x, weight=weight, runtime_gather_output=True)
    return logits.transpose(0, 1).contiguous()
