"""FP8 numerics without Transformer Engine: per-tensor scales, saturating casts, the GEMM.

A tensor ``x`` is held as ``q = saturate(x * scale)`` in ``float8_e4m3fn`` (max 448) or
``float8_e5m2`` (max 57344) with ``scale = (fp8 max / amax) / 2**margin`` (Transformer Engine's
rule; a zero or non-finite amax keeps the previous scale). The GEMM of two such tensors is
``(q_a @ q_b^T) / (scale_a * scale_b)``: ``torch._scaled_mm`` on CUDA devices with FP8 tensor
cores (compute capability 8.9+); elsewhere the FP8 values, exact in bf16 and fp32, are multiplied
in that precision with fp32 accumulation (PyTorch's CPU ``_scaled_mm`` is a reference loop).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from anyspeed.features.fp8.settings import Fp8Settings

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
ROLES = ("input", "weight", "grad")


def dtype_of(settings: Fp8Settings, role: str) -> torch.dtype:
    """The FP8 type of an operand: gradients are e5m2 in the ``hybrid`` format."""
    return E5M2 if role == "grad" and settings.format == "hybrid" else E4M3


def amax(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The fp32 absolute maximum of ``x``, the maximum over ``group`` (a shard's peers)."""
    out = x.detach().abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def scale_for(
    amax_: torch.Tensor, dtype: torch.dtype, margin: int, previous: torch.Tensor | None = None
) -> torch.Tensor:
    """``(fp8 max / amax) / 2**margin``; ``previous`` (or 1) where amax is 0 or not finite."""
    scale = torch.finfo(dtype).max / amax_ / 2.0**margin
    keep = torch.ones_like(amax_) if previous is None else previous
    ok = (amax_ > 0) & torch.isfinite(amax_) & torch.isfinite(scale)
    return torch.where(ok, scale, keep)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale`` in fp32, saturated to ``dtype``'s range, rounded to ``dtype``."""
    top = torch.finfo(dtype).max
    return (x.float() * scale).clamp_(-top, top).to(dtype)


@functools.cache
def fp8_tensor_cores(index: int) -> bool:
    """Whether CUDA device ``index`` has FP8 tensor cores (compute capability 8.9 and up)."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


def _scaled_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` runs ``a @ b^T`` in FP8 tensor cores on this device."""
    if a.device.type != "cuda" or not fp8_tensor_cores(a.device.index or 0):
        return False
    both_e5m2 = a.dtype == E5M2 and b.dtype == E5M2
    return not both_e5m2 and a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0


def compute_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The precision an emulated GEMM multiplies FP8 values in (exact for both formats)."""
    return torch.bfloat16 if out_dtype in (torch.bfloat16, torch.float16) else torch.float32


def widen(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q``'s FP8 values in ``dtype`` (exact); other tensors as they are."""
    return q.to(dtype) if q.dtype in (E4M3, E5M2) else q


def operand(q: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``q`` ready for several :func:`mm` calls: as is where FP8 tensor cores take it, else
    widened once (the backward's output gradient feeds two GEMMs)."""
    if q.device.type == "cuda" and fp8_tensor_cores(q.device.index or 0):
        return q
    return widen(q, compute_dtype(out_dtype))


def mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a @ b^T`` of two quantized 2-D operands (``a`` [m, k], ``b`` [n, k]; FP8 or already
    :func:`widen`'d) in ``out_dtype``."""
    if a.dtype in (E4M3, E5M2) and b.dtype in (E4M3, E5M2) and _scaled_mm_fits(a, b):
        return torch._scaled_mm(
            a.contiguous(),
            b.contiguous().t(),
            scale_a=a_scale.reciprocal(),
            scale_b=b_scale.reciprocal(),
            out_dtype=out_dtype,
        )
    inv = (a_scale * b_scale).reciprocal()
    compute = compute_dtype(out_dtype)
    out = widen(a, compute) @ widen(b, compute).t()
    if out.dtype == torch.float32:
        return out.mul_(inv).to(out_dtype)
    return (out.float() * inv).to(out_dtype)  # bf16 x an fp32 tensor would round the scale


class Scales:
    """One linear layer's per-role scales: from the tensor itself (``tensorwise``), or from the
    amax history of its earlier calls (``delayed``; the first call uses its own amax)."""

    def __init__(self, settings: Fp8Settings) -> None:
        self.settings = settings
        self.history: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor] = {}

    def __call__(self, role: str, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The scale to quantize ``x`` (role ``input``/``weight``/``grad``) with now."""
        s, dtype = self.settings, dtype_of(self.settings, role)
        now = amax(x, group)
        if s.recipe == "tensorwise":
            return scale_for(now, dtype, s.margin)
        if role not in self.history:  # first call: no history yet
            self.history[role] = now.new_zeros(s.amax_history_len)
            self.scale[role] = scale_for(now, dtype, s.margin)
        used = self.scale[role]
        if torch.is_grad_enabled() or role == "grad":  # no-grad passes leave the history alone
            hist = torch.roll(self.history[role], 1)
            hist[0] = now
            self.history[role] = hist
            stat = hist.amax() if s.amax_compute_algo == "max" else hist[0]
            self.scale[role] = scale_for(stat, dtype, s.margin, used)
        return used
