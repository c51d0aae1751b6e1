"""DeepSeek-V3.2's sparse attention (DSA) on multi-latent attention, in plain PyTorch.

A lightning indexer scores every key for each query, ``sum_h w_h * relu(q_h . k)``, from the
query's low-rank latent and the layer's input; the attention then sees only the ``topk`` keys
with the highest scores. The indexer is trained apart from the model: its inputs are detached,
and it learns from a KL loss towards the main attention's probabilities (summed over heads,
``--dsa-indexer-loss-coeff``). transformers' ``DeepseekV32ForCausalLM`` is the reference.
Megatron-Core 0.16.1's own ``DSAttention`` differs from it (RoPE on the last channels of the
indexer's heads, interleaved; a Hadamard transform that needs CUDA and bf16; no spec on the
local path; no key cache for generation), so this one keeps only Megatron's configuration
fields, the tensor names and the loss. Generation keeps each layer's indexer keys on the
inference context next to the KV cache.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from torch.utils.checkpoint import checkpoint

from anyspeed.models.mla import LatentAttention

KEYS = "_anyspeed_indexer_keys"  # attribute of the inference context: {layer: [b, total, d]}
_EPS = 1e-6  # the indexer key norm's epsilon (DeepSeek's and transformers' constant)
_HEADS_AT_ONCE = 8  # indexer heads scored together: [b, s, 8, t] at most at a time


class _Linear(torch.nn.Module):
    """A bias-free linear layer whose whole weight every TP rank holds (the indexer's)."""

    def __init__(self, inputs: int, outputs: int, config: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(outputs, inputs))
        config.init_method(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


class Indexer(MegatronModule):
    """The lightning indexer of one layer: index scores [b, sq, skv] in fp32."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        heads, dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.heads, self.dim = heads, dim
        self.linear_wq_b = _Linear(config.q_lora_rank or config.hidden_size, heads * dim, config)
        self.linear_wk = _Linear(config.hidden_size, dim, config)
        self.k_norm = torch.nn.LayerNorm(dim, eps=_EPS)
        self.linear_weights_proj = _Linear(config.hidden_size, heads, config)

    def forward(
        self, x: torch.Tensor, qr: torch.Tensor, freqs: torch.Tensor, mscale: float, keys: Any
    ) -> torch.Tensor:
        """``x`` [s, b, h] (the attention's input), ``qr`` [s, b, q_lora] (the query latent
        after its norm), ``freqs`` [s, 1, 1, rope] of their positions; ``keys(k)`` returns
        every key so far [skv, b, d] (the cache's, or ``k`` itself)."""
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        s, b = x.shape[:2]
        q = self.linear_wq_b(qr).view(s, b, self.heads, self.dim)
        k = self.k_norm(self.linear_wk(x))[:, :, None]  # one key head [s, b, 1, d]
        # RoPE on the first channels of each head, halves rotated (not interleaved)
        q = _apply_rotary_pos_emb_bshd(q, freqs, mscale=mscale)
        k = keys(_apply_rotary_pos_emb_bshd(k, freqs, mscale=mscale)[:, :, 0])
        weights = F.linear(x.float(), self.linear_weights_proj.weight.float()) * self.heads**-0.5
        # sum_h w[b, s, h] * relu(q[b, s, h] . k[b, t] / sqrt(d)), a few heads at a time; with
        # the indexer loss each part is recomputed in backward ([b, s, heads, t] is not kept)
        qf, kf = q.float().permute(1, 0, 2, 3), k.float().transpose(0, 1)  # [b,s,H,d] [b,t,d]
        weights = weights.permute(1, 0, 2)  # [b, s, H]
        scores = qf.new_zeros(b, s, kf.shape[1])
        for h in range(0, self.heads, _HEADS_AT_ONCE):
            part = (qf[:, :, h : h + _HEADS_AT_ONCE], kf, weights[:, :, h : h + _HEADS_AT_ONCE])
            if torch.is_grad_enabled() and any(t.requires_grad for t in part):
                scores = scores + checkpoint(_weighted_relu, *part, self.dim, use_reentrant=False)
            else:
                scores = scores + _weighted_relu(*part, self.dim)
        return scores


def _weighted_relu(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, dim: int) -> torch.Tensor:
    """``sum_h w[b, s, h] * relu(q[b, s, h] . k[b, t] / sqrt(dim))`` -> [b, s, t]."""
    x = torch.relu(torch.einsum("bshd,btd->bsht", q, k) * dim**-0.5)
    return (x * w[..., None]).sum(dim=2)


class SparseLatentAttention(LatentAttention):
    """MLA's core attention over the keys the indexer selects (``core_attention`` of
    :class:`SparseMLASelfAttention`); with ``--dsa-indexer-loss-coeff`` the indexer's KL loss
    joins the backward pass."""

    def __init__(self, config: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, layer_number, *args, **kwargs)
        self.layer_number = layer_number
        self.topk = config.dsa_indexer_topk
        self.loss_coeff = config.dsa_indexer_loss_coeff or 0.0
        self.sparse_loss = bool(config.dsa_indexer_use_sparse_loss)
        self.indexer = Indexer(config)
        if not self.loss_coeff:  # learns only from its loss: frozen without it, as in transformers
            self.indexer.requires_grad_(False)
        self.rope: Any = None  # the attention's rotary embedding (set by the attention)
        self.context: Any = None  # the inference context of the current call

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        x: torch.Tensor | None = None,
        qr: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if x is None or qr is None or attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("DSA: needs the attention's input, no bias or packed input")
        sq, skv = query.shape[0], key.shape[0]
        hidden = _hidden(attention_mask, query.shape[1], sq, skv, query.device)
        scores = self.indexer(*self._inputs(x, qr, skv - sq), self._keys(skv - sq))
        scores = scores.masked_fill(hidden, torch.finfo(torch.float32).min)
        top = scores.topk(min(self.topk, skv), dim=-1).indices
        keep = torch.zeros_like(hidden).scatter_(-1, top, True) & ~hidden
        mask = ~keep[:, None]  # [b, 1, sq, skv], True: hidden
        out = super().forward(query, key, value, mask, attn_mask_type)
        if self.training and self.loss_coeff > 0 and torch.is_grad_enabled():
            kl = indexer_kl(scores, top, query, key, self.softmax_scale, self.sparse_loss)
            track(kl)
            out = IndexerLoss.apply(out, kl * self.loss_coeff)
        return out

    def _inputs(self, x: torch.Tensor, qr: torch.Tensor, start: int) -> tuple[Any, ...]:
        """The indexer's inputs, detached, the whole sequence (gathered under SP), and the
        rotary angles of their positions."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        x, qr = x.detach(), qr.detach()
        if self.config.sequence_parallel and self.config.tensor_model_parallel_size > 1:
            x, qr = (gather_from_sequence_parallel_region(t) for t in (x, qr))
        emb = self.rope(start + x.shape[0])
        freqs, mscale = emb if isinstance(emb, tuple) else (emb, 1.0)
        return x, qr, freqs[start:].to(x.device), mscale

    def _keys(self, start: int) -> Any:
        """``keys(k)``: with an inference context, ``k`` [s, b, d] joins the layer's cached
        indexer keys at ``start`` and every key so far is returned."""
        ctx = self.context
        if ctx is None:
            return lambda k: k

        def cached(k: torch.Tensor) -> torch.Tensor:
            held = held_keys(ctx)
            end = start + k.shape[0]
            store = held.get(self.layer_number)
            if store is None or start == 0:
                store = k.new_zeros(ctx.max_sequence_length, k.shape[1], k.shape[2])
                held[self.layer_number] = store
            store[start:end] = k
            return store[:end]

        return cached


class SparseMLASelfAttention(MLASelfAttention):
    """MLA whose core attention is :class:`SparseLatentAttention`: hands it the rotary
    embedding and each call's inference context."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # a reference, not a submodule: the rotary embedding stays the attention's own
        object.__setattr__(self.core_attention, "rope", self.rotary_pos_emb)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ctx = kwargs.get("inference_context") or kwargs.get("inference_params")
        self.core_attention.context = ctx
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.core_attention.context = None


def _hidden(mask: torch.Tensor | None, b: int, sq: int, skv: int, device: Any) -> torch.Tensor:
    """[b, sq, skv] True where a query may not see a key: the mask given, else causal (the
    queries are the last ``sq`` positions)."""
    if mask is not None:
        return mask.to(torch.bool).to(device).expand(b, 1, sq, skv)[:, 0]
    causal = torch.ones(sq, skv, dtype=torch.bool, device=device).triu(skv - sq + 1)
    return causal.expand(b, sq, skv)


def held_keys(context: Any) -> dict[int, torch.Tensor]:
    """The indexer keys ``context`` holds per layer (created empty on first use)."""
    if not hasattr(context, KEYS):
        setattr(context, KEYS, {})
    return getattr(context, KEYS)


def reorder_keys(context: Any, rows: torch.Tensor) -> None:
    """Keep rows ``rows`` of every layer's indexer keys (beam search), as the KV cache does."""
    held = held_keys(context)
    for layer, keys in held.items():
        held[layer] = keys[:, rows.to(keys.device)]


def indexer_kl(
    scores: torch.Tensor,
    top: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    softmax_scale: float,
    sparse: bool,
) -> torch.Tensor:
    """KL(attention || indexer) per query, averaged (Megatron-Core's definition): the target is
    the main attention's probabilities from the detached query [sq, b, n, d] and key, summed
    over every head (all TP ranks') and normalised; the prediction is the softmax of the masked
    index scores [b, sq, skv]. ``sparse``: both only over the selected keys."""
    from megatron.core import parallel_state as ps

    sq, b, n, _ = query.shape
    skv = key.shape[0]
    q, k = query.detach().float().permute(1, 2, 0, 3), key.detach().float().permute(1, 2, 3, 0)
    logits = torch.matmul(q, k) * softmax_scale  # [b, n, sq, skv]
    low = torch.finfo(torch.float32).min
    causal = torch.ones(sq, skv, dtype=torch.bool, device=q.device).triu(skv - sq + 1)
    logits = logits.masked_fill(causal, low)
    if sparse:
        outside = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, top, False)
        logits = logits.masked_fill(outside[:, None], low)
        scores = scores.masked_fill(outside, low)
    target = torch.softmax(logits, dim=-1).sum(dim=1)  # [b, sq, skv]
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(target, group=ps.get_tensor_model_parallel_group())
    target = target / target.sum(dim=-1, keepdim=True)
    predicted = torch.softmax(scores, dim=-1)
    kl = target * (torch.log(target + 1e-10) - torch.log(predicted + 1e-10))
    return kl.sum(dim=-1).mean()


class IndexerLoss(torch.autograd.Function):
    """Identity on the attention's output whose backward also starts the indexer loss's, at
    the main loss's scale (``scale``: set per step by :func:`set_loss_scale`)."""

    scale = 1.0

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, IndexerLoss.scale)


def set_loss_scale(config: Any, num_microbatches: int) -> None:
    """The indexer loss's gradient scale for the next step: the main loss's (Megatron divides
    each micro-batch's loss by their number, and multiplies by the fp16 loss scale)."""
    from anyspeed.device import torch_device

    scale = 1.0
    if getattr(config, "grad_scale_func", None) is not None:
        scale = float(config.grad_scale_func(torch.ones(1, device=torch_device())))
    if not getattr(config, "calculate_per_token_loss", False):
        scale /= num_microbatches
    IndexerLoss.scale = scale


_TRACKED: dict[str, Any] = {"sum": 0.0, "count": 0}


def track(kl: torch.Tensor) -> None:
    """Keep one layer's KL of this step for :func:`step_kl` (no device sync)."""
    _TRACKED["sum"] = _TRACKED["sum"] + kl.detach().double()
    _TRACKED["count"] += 1


def step_kl() -> float:
    """The indexer KL of the step just run, averaged over layers, micro-batches and replicas
    (a collective: every rank calls it); the tracker is cleared for the next step."""
    from megatron.core import parallel_state as ps

    from anyspeed.device import torch_device

    total = torch.zeros(2, dtype=torch.float64, device=torch_device())
    if ps.get_tensor_model_parallel_rank() == 0:  # TP ranks hold the same values
        total[0] += torch.as_tensor(_TRACKED["sum"], dtype=torch.float64).to(total.device)
        total[1] += _TRACKED["count"]
    _TRACKED.update(sum=0.0, count=0)
    torch.distributed.all_reduce(total)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def use_sparse_core(spec: Any) -> Any:
    """``spec`` (a layer spec or a block spec of layer specs, MLA's) with DSA's attention and
    core attention in every layer."""
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    for layer in layers:
        attn = layer.submodules.self_attention
        attn.module = SparseMLASelfAttention
        attn.submodules.core_attention = SparseLatentAttention
    return spec


def dsa_config(model: Any) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of DSA (none for other models)."""
    if model.experimental_attention_variant != "dsa":
        return {}
    return dict(
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=model.dsa_indexer_n_heads,
        dsa_indexer_head_dim=model.dsa_indexer_head_dim,
        dsa_indexer_topk=model.dsa_indexer_topk,
        dsa_indexer_loss_coeff=model.dsa_indexer_loss_coeff,
        dsa_indexer_use_sparse_loss=model.dsa_indexer_use_sparse_loss,
    )
