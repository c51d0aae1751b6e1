"""Parameter and FLOP counts of a :class:`~anyspeed.models.config.ModelConfig` (``anyspeed
models``, ``anyspeed memory`` and the MFU figures read them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from anyspeed.models.config import ModelConfig


def num_parameters(m: ModelConfig) -> int:
    """Parameter count (embeddings included, tied ones counted once)."""
    h = m.hidden_size
    emb = m.vocab_size * h * (1 if m.tie_embeddings else 2)
    mlps = sum(_mlp_parameters(m, moe)[0] for moe in m.moe_layers())
    return _mixers(m) + _norms(m) + mlps + emb + h + mtp_parameters(m)


def active_parameters(m: ModelConfig) -> int:
    """Parameters a token passes through in the decoder (top-k experts; no MTP layers)."""
    h = m.hidden_size
    emb = m.vocab_size * h * (1 if m.tie_embeddings else 2)
    mlps = sum(_mlp_parameters(m, moe)[1] for moe in m.moe_layers())
    return _mixers(m) + _norms(m) + mlps + emb + h


def _norms(m: ModelConfig) -> int:
    """The layers' norms: before attention and MLP, and after each with ``--post-norm``."""
    return (4 if m.post_norm else 2) * m.hidden_size * m.num_layers


def _mixers(m: ModelConfig) -> int:
    """Parameters of every layer's attention or gated DeltaNet."""
    linear = sum(m.linear_attention_layers())
    return (m.num_layers - linear) * _attention_parameters(m) + linear * (delta_net_parameters(m))


def delta_net_parameters(m: ModelConfig) -> int:
    """One gated DeltaNet: the [q; k; v; z; beta; alpha] projection, the causal convolution
    over q, k, v, per-head decay (A_log, dt_bias), the gated output norm, the output."""
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    v, heads = (
        m.linear_num_value_heads * m.linear_value_head_dim,
        m.linear_num_value_heads,
    )
    proj = m.hidden_size * (2 * qk + 2 * v + 2 * heads)
    conv = (2 * qk + v) * m.linear_conv_kernel_dim
    return proj + conv + 2 * heads + m.linear_value_head_dim + v * m.hidden_size


def mtp_parameters(m: ModelConfig) -> int:
    """Parameters of the multi-token prediction layers (they share the embedding and the
    output layer): two norms, the [embedding; hidden] projection, a decoder layer like the
    last one, and a final norm each."""
    h, last = m.hidden_size, m.moe_layers()[-1]
    layer = _attention_parameters(m) + 2 * h + _mlp_parameters(m, last)[0]
    return (m.mtp_num_layers or 0) * (2 * h + 2 * h * h + layer + h)


def _attention_parameters(m: ModelConfig) -> int:
    """Parameters of one layer's attention (multi-latent: low-rank Q and KV projections)."""
    h, d, n = m.hidden_size, m.head_dim, m.num_attention_heads
    if m.multi_latent_attention:
        qk, rope, r = (
            m.qk_head_dim + m.qk_pos_emb_head_dim,
            m.qk_pos_emb_head_dim,
            m.q_lora_rank,
        )
        q = h * r + r + r * n * qk if r else h * n * qk
        kv = h * (m.kv_lora_rank + rope) + m.kv_lora_rank
        kv += m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim)
        return q + kv + n * m.v_head_dim * h + indexer_parameters(m)
    q, kv = n * d, m.num_query_groups * d
    attn = h * (q + 2 * kv) + q * h + (h * q if m.attention_output_gate else 0)
    if m.add_qkv_bias or m.add_bias_linear:
        attn += q + 2 * kv
    if m.add_bias_linear:
        attn += h
    if m.qk_layernorm:
        attn += 2 * d
    if m.softmax_type == "learnable":
        attn += n
    return attn


def _mlp_parameters(m: ModelConfig, moe: bool) -> tuple[int, int]:
    """(all, active per token) parameters of one layer's MLP or MoE block."""
    mats, h = (3 if m.gated else 2), m.hidden_size
    bias = (mats - 1) * m.ffn_hidden_size + h if m.add_bias_linear else 0
    if not moe:
        dense = mats * h * m.ffn_hidden_size + bias
        return dense, dense
    ffn = m.expert_ffn_size
    expert = mats * h * ffn + ((mats - 1) * ffn + h if m.add_bias_linear else 0)
    shared = mats * h * (m.moe_shared_expert_intermediate_size or 0)
    shared += h if m.moe_shared_expert_gate else 0
    router = (h + int(m.add_bias_linear)) * (m.num_experts or 0)
    return (
        (m.num_experts or 0) * expert + shared + router,
        m.moe_router_topk * expert + shared + router,
    )


def flops_per_token(m: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters plus causal attention scores; a
    gated DeltaNet layer its projections plus reading and writing its state."""
    h, d, heads = m.hidden_size, m.head_dim, m.num_attention_heads
    kv = m.num_query_groups / heads
    attn = h * heads * d * (2 + 2 * kv) + (h * heads * d if m.attention_output_gate else 0)
    linear = sum(m.linear_attention_layers())
    full = m.num_layers - linear
    mlps = sum(_mlp_parameters(m, moe)[1] for moe in m.moe_layers())
    matmul_params = full * attn + linear * delta_net_parameters(m) + mlps
    state = m.linear_num_value_heads * m.linear_key_head_dim * m.linear_value_head_dim
    mixing = full * heads * d * seq_length + linear * 2 * state
    return 6.0 * (matmul_params + h * m.vocab_size) + 6.0 * mixing


def indexer_parameters(m: ModelConfig) -> int:
    """DeepSeek-V3.2's indexer: query heads from the query latent, one key (with a LayerNorm)
    and the heads' weights from the layer's input."""
    if m.experimental_attention_variant != "dsa":
        return 0
    heads, d, h = m.dsa_indexer_n_heads or 0, m.dsa_indexer_head_dim or 0, m.hidden_size
    return (m.q_lora_rank or h) * heads * d + h * d + 2 * d + h * heads
