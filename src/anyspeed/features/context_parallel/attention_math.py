"""Blockwise attention pieces shared by the context-parallel algorithms.

``partial_attention`` returns a block's output and its row log-sum-exp so partial results over
different key blocks can be merged exactly; ``block_grads`` is the matching backward given the
final (merged) output and log-sum-exp. On the CPU both run through PyTorch's fused flash
kernels and on CUDA through its memory-efficient kernels (in fp32), which return (and accept) the
log-sum-exp; elsewhere, or with ``FUSED = False``, plain fp32 math that works on every device.
The tests check the fused and the plain path against single-device attention.
"""

from __future__ import annotations

import torch

FUSED = True  # use the device's fused flash kernels where they expose the log-sum-exp
_aten = torch.ops.aten


def _fused(q: torch.Tensor) -> str | None:
    """Which fused kernel family serves ``q``'s device: "cpu" (flash), "cuda" (memory-efficient,
    which takes fp32 too), or None for the plain-math path."""
    if not FUSED:
        return None
    if q.device.type == "cpu" and hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "cpu"
    if q.device.type == "cuda" and hasattr(
        _aten, "_scaled_dot_product_efficient_attention_backward"
    ):
        return "cuda"
    return None


def _lse_len(sq: int) -> int:
    """Rows of the log-sum-exp the CUDA memory-efficient kernel keeps (padded to 32)."""
    return (sq + 31) // 32 * 32


def _scores(q, k, scale, causal):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1 + sk - sq)
        s = s.masked_fill(mask, float("-inf"))
    return s


def expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat K/V heads [b, hkv, s, d] to ``heads`` query heads (GQA)."""
    rep = heads // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def partial_attention(q, k, v, scale: float, causal: bool):
    """(out [b,h,sq,d] fp32, lse [b,h,sq] fp32) of q against one key block."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    kind = _fused(q)
    if kind == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.to(q.dtype), v.to(q.dtype), 0.0, causal, scale=scale
        )
        return out.float(), lse.float()
    if kind == "cuda":  # in fp32: the bf16/fp16 backward gave NaNs with a supplied lse (H200)
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            q.float(), k.float(), v.float(), None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]].float()
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.float()), lse


def merge(out, lse, blk_out, blk_lse):
    """Merge a block's (out, lse) into the running ones (both may be None at the start)."""
    if out is None:
        return blk_out, blk_lse
    new = torch.logaddexp(lse, blk_lse)
    out = out * torch.exp(lse - new).unsqueeze(-1) + blk_out * torch.exp(blk_lse - new).unsqueeze(
        -1
    )
    return out, new


def block_grads(q, k, v, do, out, lse, scale: float, causal: bool):
    """(dq, dk, dv) contributions of one key block, given the merged output and lse."""
    hkv = k.shape[1]
    ke, ve = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    kind = _fused(q)
    if kind == "cpu":
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.to(q.dtype),
            q,
            ke.to(q.dtype),
            ve.to(q.dtype),
            out.to(q.dtype),
            lse.float(),
            0.0,
            causal,
            scale=scale,
        )
        return _fold_gqa(dq.float(), dk.float(), dv.float(), hkv)
    if kind == "cuda":
        b, h, sq, _ = q.shape
        lse_k = torch.zeros(b, h, _lse_len(sq), dtype=torch.float32, device=q.device)
        lse_k[..., :sq] = lse
        no_rng = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            do.float().contiguous(),
            q.float(),
            ke.float(),
            ve.float(),
            None,
            out.float().contiguous(),
            lse_k,
            no_rng,
            no_rng,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return _fold_gqa(dq.float(), dk.float(), dv.float(), hkv)
    s = _scores(q, ke, scale, causal)
    p = torch.exp(s - lse.unsqueeze(-1))
    dof = do.float()
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, ve.float().transpose(-1, -2))
    delta = (dof * out).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, ke.float())
    dk = torch.matmul(ds.transpose(-1, -2), q.float())
    return _fold_gqa(dq, dk, dv, hkv)


def _fold_gqa(dq, dk, dv, hkv: int):
    """Sum the K/V gradients of each group's query heads back onto their K/V head."""
    if hkv != dq.shape[1]:
        b, h, sk, d = dk.shape
        dk = dk.reshape(b, hkv, h // hkv, sk, d).sum(2)
        dv = dv.reshape(b, hkv, h // hkv, sk, d).sum(2)
    return dq, dk, dv
