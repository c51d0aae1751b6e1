"""The shared tensor work behind every family mapping.

The model is walked in *groups* — the embedding, each decoder layer, then the head (final norm
and output layer) — so conversions stream one group at a time. Megatron tensors here carry the
names and full (TP1/PP1) shapes of Megatron-Core's GPTModel (local spec) state dict;
:func:`shard_tp` / :func:`merge_tp` give the per-rank shards of Megatron-LM's tensor-parallel
layout (column-parallel on dim 0, row-parallel on dim 1, SwiGLU's fc1 as [gate_r; up_r]).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from anyspeed.convert.expert_slices import hf_slice_shape, slice_to_hf, slice_to_megatron
from anyspeed.convert.fused import (  # noqa: F401 - re-exported: the engine's tensor vocabulary
    PERMUTED,
    delta_net_shapes,
    fuse,
    fuse_lazy,
    fuse_qkv,
    part_rows,
    split_fused,
)
from anyspeed.distributed.resharding import (  # noqa: F401 - re-exported, as above
    TP_PARTS,
    Stacked,
    materialize,
    merge_tp,
    shard_shape,
    shard_tp,
    take_rows,
    tp_parts,
    tp_rule,
)
from anyspeed.models.config import ModelConfig
from anyspeed.models.families import ExpertSlice, FamilyMapping, Fused

EMBED, HEAD = "embed", "head"
Group = str | int

# Tensors whose first dim is the (padded) vocabulary.
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


MTP_PREFIX = "mtp.layers.{j}."
_Q_LORA = ("linear_q_down_proj.", "linear_q_up_proj.", "q_layernorm.")


def groups(preset: ModelConfig) -> list[Group]:
    """The embedding, each decoder layer, each multi-token prediction layer, the head."""
    return [EMBED, *range(preset.num_layers + (preset.mtp_num_layers or 0)), HEAD]


Source = str | Fused | ExpertSlice


def _present(name: str, preset: ModelConfig) -> bool:
    """Whether layer tensor ``name`` exists in ``preset``: multi-latent attention projects
    queries at full rank (``linear_q_proj``) or through a low-rank down/norm/up path; a family
    whose models may or may not have QK norm and QKV biases (GLM-4.5) maps both."""
    if not preset.multi_latent_attention:
        if name.startswith(("self_attention.q_layernorm.", "self_attention.k_layernorm.")):
            return preset.qk_layernorm
        return name != "self_attention.linear_qkv.bias" or preset.add_qkv_bias
    if not name.startswith("self_attention."):
        return True
    if preset.q_lora_rank:
        return "linear_q_proj." not in name
    return not any(p in name for p in _Q_LORA)


def _layer_entries(m: FamilyMapping, preset: ModelConfig, i: int) -> dict[str, Source]:
    """Layer ``i``'s names relative to the layer: a MoE layer's ``mlp.*`` are its router,
    shared expert (when the model has one) and every expert's, ``{e}`` filled in. An MTP
    layer (``i`` past the decoder) is built like the last decoder layer."""
    layer = {k: v for k, v in m.layer.items() if _present(k, preset)}
    last = min(i, preset.num_layers - 1)
    if m.linear and preset.linear_attention_layers()[last]:  # a gated DeltaNet layer
        layer = {k: v for k, v in layer.items() if not k.startswith("self_attention.")}
        layer.update(m.linear)
    if not preset.moe_layers()[last]:
        return layer
    out = {k: v for k, v in layer.items() if not k.startswith("mlp.")}
    for k, v in m.moe.items():
        if k.startswith("mlp.shared_experts.") and not (
            preset.moe_shared_expert_intermediate_size
            and (preset.moe_shared_expert_gate or not k.endswith("gate_weight"))
        ):
            continue
        out[k] = v
    for e in range(preset.num_experts or 0):
        for k, v in m.expert.items():
            out[k.format(e=e)] = _renamed(v, lambda n, e=e: n.format(e=e), e)
    return out


def _renamed(v: Source, rename: Callable[[str], str], expert: int | None = None) -> Source:
    """``v`` with its HF name(s) passed through ``rename`` (and its expert set)."""
    if isinstance(v, Fused):
        return Fused(v.kind, tuple(rename(p) for p in v.parts))
    if isinstance(v, ExpertSlice):
        e = v.expert if expert is None else expert
        return ExpertSlice(rename(v.name), v.layout, e)
    return rename(v)


def entries(m: FamilyMapping, preset: ModelConfig, group: Group) -> dict[str, Source]:
    """Megatron name -> HF name (or Fused of HF names, or an expert's slice) for one group."""
    if isinstance(group, int):
        mg, hf = m.mg_layer.format(i=group), m.hf_layer.format(i=group)
        mtp = group >= preset.num_layers
        if mtp:
            mg = MTP_PREFIX.format(j=group - preset.num_layers)
        out: dict[str, Source] = {
            mg + ("transformer_layer." if mtp else "") + k: _renamed(v, lambda n: hf + n)
            for k, v in _layer_entries(m, preset, group).items()
        }
        out.update((mg + k, hf + v) for k, v in m.mtp.items() if mtp)
        return out
    out = {}
    for k, v in m.top.items():
        if (group == EMBED) != k.startswith("embedding."):
            continue
        if preset.tie_embeddings and k == "output_layer.weight":
            continue
        out[k] = v
    return out


def mtp_copies(m: FamilyMapping, preset: ModelConfig) -> dict[str, str]:
    """HF name -> the Megatron tensor it copies, for the embedding and output layer copies an
    HF checkpoint keeps in each MTP layer (the output layer is the embedding when tied)."""
    out = {}
    for j in range(preset.mtp_num_layers or 0):
        hf = m.hf_layer.format(i=preset.num_layers + j)
        for name, mg in m.mtp_copies.items():
            tied = preset.tie_embeddings and mg == "output_layer.weight"
            out[hf + name] = "embedding.word_embeddings.weight" if tied else mg
    return out


def hf_layer_at_least(m: FamilyMapping, name: str, first: int) -> bool:
    """Whether HF tensor ``name`` belongs to a layer numbered ``first`` or later."""
    prefix = m.hf_layer.split("{", 1)[0]
    rest = name[len(prefix) :] if name.startswith(prefix) else ""
    number = rest.split(".", 1)[0]
    return number.isdigit() and int(number) >= first


def megatron_shape(name: str, preset: ModelConfig, vocab_rows: int) -> tuple[int, ...]:
    """Full (TP1) shape of Megatron tensor ``name`` for ``preset``."""
    h, d, ffn = preset.hidden_size, preset.head_dim, preset.ffn_hidden_size
    gates = preset.num_attention_heads if preset.attention_output_gate else 0
    qkv_rows = (preset.num_attention_heads + gates + 2 * preset.num_query_groups) * d
    shapes = {
        "word_embeddings.weight": (vocab_rows, h),
        "output_layer.weight": (vocab_rows, h),
        "output_layer.score.weight": (1, h),  # a reward model's head
        "linear_qkv.weight": (qkv_rows, h),
        "linear_qkv.bias": (qkv_rows,),
        "linear_proj.weight": (h, preset.num_attention_heads * d),
        "linear_proj.bias": (h,),
        "core_attention.softmax_offset": (preset.num_attention_heads,),
        "linear_fc1.weight": (2 * ffn, h),
        "linear_fc1.bias": (2 * ffn,),
        "linear_fc2.weight": (h, ffn),
        "q_layernorm.weight": (d,),
        "k_layernorm.weight": (d,),
        "eh_proj.weight": (h, 2 * h),
        **delta_net_shapes(preset),
    }
    if preset.multi_latent_attention:
        n, rope, lora = preset.num_attention_heads, preset.qk_pos_emb_head_dim, preset.kv_lora_rank
        q_rank = preset.q_lora_rank or 0
        shapes.update(
            {
                "linear_q_proj.weight": (n * (preset.qk_head_dim + rope), h),
                "linear_q_down_proj.weight": (q_rank, h),
                "q_layernorm.weight": (q_rank,),
                "linear_q_up_proj.weight": (n * (preset.qk_head_dim + rope), q_rank),
                "linear_kv_down_proj.weight": (lora + rope, h),
                "kv_layernorm.weight": (lora,),
                "linear_kv_up_proj.weight": (n * (preset.qk_head_dim + preset.v_head_dim), lora),
                "linear_proj.weight": (h, n * preset.v_head_dim),
            }
        )
    if preset.experimental_attention_variant == "dsa":
        heads, d = preset.dsa_indexer_n_heads or 0, preset.dsa_indexer_head_dim or 0
        shapes.update(
            {
                "indexer.linear_wq_b.weight": (heads * d, preset.q_lora_rank or h),
                "indexer.linear_wk.weight": (d, h),
                "indexer.k_norm.weight": (d,),
                "indexer.k_norm.bias": (d,),
                "indexer.linear_weights_proj.weight": (heads, h),
            }
        )
    if ".mlp." in name and preset.is_moe:
        ffn = preset.moe_shared_expert_intermediate_size if ".shared_experts." in name else ffn
        ffn = preset.expert_ffn_size if ".experts.local_experts." in name else ffn
        shapes.update(
            {
                "linear_fc1.weight": (2 * ffn, h),
                "linear_fc2.weight": (h, ffn),
                "linear_fc1.bias": (2 * ffn,),
                "router.weight": (preset.num_experts, h),
                "router.bias": (preset.num_experts,),
                "gate_weight": (1, h),
                "router.expert_bias": (preset.num_experts,),
            }
        )
    for suffix, shape in shapes.items():
        if name.endswith(suffix):
            return shape
    return (h,)  # the hidden-size norms


def hf_shapes(m: FamilyMapping, preset: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the model with the shape its config implies."""
    out = {}
    q_rows = preset.num_attention_heads * preset.head_dim
    kv_rows = preset.num_query_groups * preset.head_dim
    for g in groups(preset):
        for mg, src in entries(m, preset, g).items():
            shape = megatron_shape(mg, preset, preset.vocab_size)
            if isinstance(src, ExpertSlice):
                out[src.name] = (preset.num_experts or 0, *hf_slice_shape(src.layout, shape))
                continue
            if not isinstance(src, Fused):
                out[src] = shape
                continue
            if src.kind in PERMUTED:
                rows = tuple(sum(b - a for a, b in r) for r in part_rows(src, 0, preset))
            else:
                rows = (q_rows, kv_rows, kv_rows) if src.kind == "qkv" else (shape[0] // 2,) * 2
            out.update((p, (r, *shape[1:])) for p, r in zip(src.parts, rows, strict=True))
    return out


def to_megatron(
    m: FamilyMapping,
    preset: ModelConfig,
    group: Group,
    read: Callable[[str], torch.Tensor],
    vocab_rows: int,
    stacked: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor | Stacked]:
    """The Megatron tensors of ``group`` (those named ``keep`` accepts) from HF tensors
    ``read(name)``; vocab padded with zero rows to ``vocab_rows``. With ``stacked``, fused
    tensors (QKV in Megatron's per-group order, SwiGLU's [gate; up]) and padded vocabularies
    are :class:`Stacked` views of the HF tensors: nothing is copied until a writer needs it."""
    out: dict[str, torch.Tensor | Stacked] = {}
    stacks: dict[str, torch.Tensor] = {}  # HF tensors of all experts, read once per group
    for mg, src in entries(m, preset, group).items():
        if keep is not None and not keep(mg):
            continue
        if isinstance(src, ExpertSlice):
            if src.name not in stacks:
                stacks[src.name] = read(src.name)
            out[mg] = slice_to_megatron(src.layout, stacks[src.name][src.expert])
            continue
        if isinstance(src, Fused):
            parts = [read(p) for p in src.parts]
            t = fuse_lazy(src, parts, preset) if stacked else fuse(src, parts, preset)
        else:
            t = read(src)
        if mg in VOCAB and t.shape[0] < vocab_rows:
            pad = t.new_zeros(vocab_rows - t.shape[0], *t.shape[1:])
            t = Stacked([*getattr(t, "parts", [t]), pad]) if stacked else torch.cat([t, pad])
        out[mg] = t
    return out


def to_hf(
    m: FamilyMapping,
    preset: ModelConfig,
    group: Group,
    tensors: dict[str, torch.Tensor | Stacked],
    vocab_size: int,
) -> dict[str, torch.Tensor | Stacked]:
    """The HF tensors of ``group`` from its Megatron tensors; vocab rows cut to ``vocab_size``.
    Parts of fused tensors are row views (:class:`Stacked` when made of several ranges)."""
    out: dict[str, torch.Tensor | Stacked] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for mg, dst in entries(m, preset, group).items():
        t = tensors[mg]
        if mg in VOCAB:
            t = take_rows(t, [(0, vocab_size)])
        if isinstance(dst, ExpertSlice):
            stacks.setdefault(dst.name, {})[dst.expert] = slice_to_hf(dst.layout, materialize(t))
        elif isinstance(dst, Fused):
            out.update(zip(dst.parts, split_fused(dst, t, preset), strict=True))
        else:
            out[dst] = t
    for name, by_expert in stacks.items():  # every expert of the layer, in order
        out[name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor whose storage is exactly its own bytes (``torch.save`` writes a view's
    whole storage): no copy when ``t`` is contiguous."""
    if not t.is_contiguous() or t.numel() == 0:
        return t.clone()
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return torch.from_numpy(raw).view(t.dtype).view(t.shape)
