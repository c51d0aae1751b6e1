"""``anyspeed memory``'s terms for the layers that are not grouped-query attention: multi-latent
attention (DeepSeek, Kimi-K2; with DeepSeek-V3.2's indexer) and gated DeltaNet layers
(Qwen3-Next, Qwen3.5): the parameters of one rank, as Megatron splits them over TP, and the
bytes their forward keeps for backward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from anyspeed.models import counts

if TYPE_CHECKING:
    from anyspeed.layout import Layout
    from anyspeed.models.config import ModelConfig

F32 = 4
_CHUNK = 64  # the chunked delta rule's block of tokens


def norm_bytes(tokens: int, width: int, e: int, recomputed: bool = False, fp8: bool = False) -> int:
    """A norm and the output the next linear keeps: torch's composite RMSNorm/LayerNorm keeps
    its (fp32) input, the normalised input (fp32) and 1/rms per token; recomputed, only the
    input (in the activations' dtype) stays. An FP8 linear keeps its own one-byte copy of the
    output instead (which recompute does not discard)."""
    kept = tokens * width * (1 if fp8 else e)
    if recomputed:
        return tokens * width * e + (kept if fp8 else 0)
    return 2 * tokens * width * F32 + tokens * F32 + kept


def mla_params(m: ModelConfig, tp: int) -> int:
    """One MLA layer's attention on one rank: the query projections (low-rank: down and up,
    both column-split, the norm between them whole), the KV down-projection and its norm whole
    on every rank, the KV up-projection column-split, the output row-split; DSA's indexer
    whole."""
    h, n, r, kvr = m.hidden_size, m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank
    qk, rope = m.qk_head_dim + m.qk_pos_emb_head_dim, m.qk_pos_emb_head_dim
    q = (h * r + r * n * qk) // tp + r if r else h * n * qk // tp
    kv = h * (kvr + rope) + kvr + kvr * n * (m.qk_head_dim + m.v_head_dim) // tp
    return q + kv + n * m.v_head_dim * h // tp + counts.indexer_parameters(m)


def delta_params(m: ModelConfig, tp: int) -> int:
    """One gated DeltaNet on one rank: everything split over TP but its output norm."""
    whole = m.linear_value_head_dim
    return (counts.delta_net_parameters(m) - whole) // tp + whole


def mla_activations(m: ModelConfig, lay: Layout, s: int, b: int, e: int, math: bool) -> int:
    """What one MLA layer's attention keeps (``s`` tokens of ``b`` rows on this rank):
    - the query-latent and KV-latent norms (sequence-split under SP; the KV norm's input is a
      view of the down-projection's output, rotary key included);
    - the rotary tables of the query and the key;
    - the attention: query and key heads differ in size from the value heads, which the fused
      kernels of the CPU do not take (``math``): PyTorch's math path keeps copies of q, k and
      v and the probabilities [b, heads, s, s]; CUDA's memory-efficient kernel keeps q, k, v,
      the output and the log-sum-exp;
    - the output the output projection keeps;
    - DeepSeek-V3.2's indexer, when its loss trains it (:func:`indexer_activations`)."""
    tokens, heads = s * b, m.num_attention_heads // lay.tp
    normed = tokens // lay.tp if lay.sequence_parallel else tokens
    kvr, rope, qk = m.kv_lora_rank, m.qk_pos_emb_head_dim, m.qk_head_dim + m.qk_pos_emb_head_dim
    kv_in = normed * (kvr + rope if e == F32 else kvr) * F32  # the norm's fp32 input
    total = kv_in + normed * kvr * F32 + normed * F32 + normed * kvr * e
    if m.q_lora_rank:
        total += norm_bytes(normed, m.q_lora_rank, e)
    total += 4 * s * rope * e
    total += tokens * heads * (2 * qk + m.v_head_dim) * e  # q, k, v
    if math:
        total += b * heads * s * s * e
    else:
        total += tokens * heads * m.v_head_dim * e + b * heads * s * F32
    total += tokens * heads * m.v_head_dim * e  # the output projection's input
    return total + indexer_activations(m, s, b, e)


def indexer_activations(m: ModelConfig, s: int, b: int, e: int) -> int:
    """DeepSeek-V3.2's indexer with ``--dsa-indexer-loss-coeff`` (without it the indexer keeps
    nothing: frozen, detached inputs): its fp32 queries and key, the heads' weights, the key
    norm's input and statistics, the rotary tables, the [b, s, s] fp32 index scores (masked,
    their softmax and its log), the selection (a boolean mask, the top-k indices); the
    per-head scores are recomputed in backward."""
    if m.experimental_attention_variant != "dsa" or not m.dsa_indexer_loss_coeff:
        return 0
    tokens, heads, d = s * b, m.dsa_indexer_n_heads or 0, m.dsa_indexer_head_dim or 0
    total = tokens * heads * d * F32 + tokens * heads * F32 + tokens * d * (e + F32)
    total += 2 * tokens * F32 + 4 * s * m.qk_pos_emb_head_dim * e
    return total + b * s * s * (3 * F32 + 1) + b * s * (m.dsa_indexer_topk or 0) * 8


def delta_activations(m: ModelConfig, lay: Layout, s: int, b: int, e: int) -> int:
    """What one gated DeltaNet keeps (``s`` tokens of ``b`` rows on this rank): the causal
    convolution's input and output, the q/k L2 norms' inputs, the decay and beta inputs, the
    chunked delta rule's fp32 tensors (per chunk of 64 tokens: six [64, 64] matrices per value
    head, q/k/v-sized operands and each chunk's state), the gated output norm and the output
    projection's input."""
    tp, c = lay.tp, _CHUNK
    qk = m.linear_num_key_heads * m.linear_key_head_dim // tp
    v, hv, hk = (
        m.linear_num_value_heads * m.linear_value_head_dim // tp,
        m.linear_num_value_heads // tp,
        m.linear_num_key_heads // tp,
    )
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    tokens, chunks = s * b, -(-s // c)
    padded = b * chunks * c
    conv = (2 * qk + v) * e
    total = tokens * conv + b * (s + m.linear_conv_kernel_dim - 1) * conv
    total += 2 * tokens * qk * e + 2 * tokens * hk * F32 + 3 * tokens * hv * F32
    rule = 6 * c + 5 * dk + 6 * dv + 3  # per padded token and value head
    total += padded * hv * rule * F32 + chunks * b * hv * (dk * dv + 1) * F32 + 2 * c * c
    return total + 5 * tokens * v * F32 + tokens * hv * F32 + tokens * v * e
