"""The gated delta rule (Qwen3-Next's gated DeltaNet) in plain PyTorch, on every device.

GPU stacks run it through the Triton ``fla`` package; here it is two PyTorch forms that autograd
differentiates: :func:`recurrent_gated_delta_rule` (one token at a time: the definition, and
the decode step) and :func:`chunk_gated_delta_rule` (training and prefill: matrix products
within chunks, the state carried between them).

Per head, with a state ``S`` of [key dim, value dim], each token ``t`` decays the state by
``exp(g_t)`` (``g_t <= 0``), writes the value the state lacks for its key,
``u_t = beta_t (v_t - S^T k_t)``, as ``S += k_t u_t^T``, and reads ``o_t = S^T q_t`` (queries
scaled by ``1/sqrt(key dim)``). Within a chunk with cumulative log decay ``G``, unrolling gives
``U = (I + A)^-1 beta (V - exp(G) K S0)`` with ``A_ij = beta_i exp(G_i - G_j) k_i.k_j`` for
``j < i`` (a unit lower-triangular solve), ``O = exp(G) Q S0 + (M * Q K^T) U`` with
``M_ij = exp(G_i - G_j)`` for ``j <= i``, and the chunk's end state
``exp(G_C) S0 + (exp(G_C - G) K)^T U``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the kernels' query/key norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """[b, t, h, d] inputs -> fp32 [b, h, t, d] (queries scaled), and g, beta as [b, h, t]."""
    if l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float()


def _initial(state: torch.Tensor | None, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    b, h, _, dk = q.shape
    if state is None:
        return q.new_zeros(b, h, dk, v.shape[-1])
    return state.float()


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rule token by token. q, k: [b, t, h, dk]; v: [b, t, h, dv]; g (log decay, <= 0),
    beta: [b, t, h]; state [b, h, dk, dv]. Returns ([b, t, h, dv] in v's dtype, the end state
    or None)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    state = _initial(initial_state, q, v)
    out = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        read = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        u = beta[:, :, t, None] * (v[:, :, t] - read)
        state = state + k[:, :, t, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    o = torch.stack(out, dim=2).transpose(1, 2).to(dtype)
    return o, (state if output_final_state else None)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`recurrent_gated_delta_rule`, chunk by chunk (same arguments and results)."""
    dtype, length = v.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    pad = -length % chunk_size  # zero keys, values and beta, no decay: the state is untouched
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    b, h, t, dk = q.shape
    n, c = t // chunk_size, chunk_size
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c).cumsum(-1), beta.reshape(b, h, n, c)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    diff = g[..., :, None] - g[..., None, :]  # G_i - G_j
    decay = diff.masked_fill(~lower, float("-inf")).exp()  # j <= i, else 0
    strict = lower & ~torch.eye(c, dtype=torch.bool, device=q.device)  # j < i
    a = (beta[..., None] * decay * (k @ k.transpose(-1, -2))).masked_fill(~strict, 0.0)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    within = decay * (q @ k.transpose(-1, -2))  # M * Q K^T
    state = _initial(initial_state, q[:, :, 0], v[:, :, 0])
    out = []
    for i in range(n):
        gi = g[:, :, i, :, None]
        rhs = beta[:, :, i, :, None] * (v[:, :, i] - gi.exp() * (k[:, :, i] @ state))
        u = torch.linalg.solve_triangular(eye + a[:, :, i], rhs, upper=False, unitriangular=True)
        out.append(gi.exp() * (q[:, :, i] @ state) + within[:, :, i] @ u)
        last = g[:, :, i, -1, None, None]
        state = last.exp() * state + ((last - gi).exp() * k[:, :, i]).transpose(-1, -2) @ u
    o = torch.cat(out, dim=2)[:, :, :length].transpose(1, 2).to(dtype)
    return o, (state if output_final_state else None)
