"""A torch-only stand-in for the three parts of ``emerging_optimizers`` (v0.1.0's interface)
that Megatron-Core 0.16.1's Muon (``megatron.core.optimizer.muon``) imports.

Megatron pins emerging-optimizers v0.1.0, which PyPI does not carry (its releases there need
Python >= 3.12 and renamed the arguments Megatron passes) and which imports Triton, absent from
CPU machines. Where the real package does not import, :func:`install` registers this module
under its names before Megatron's Muon is imported, so ``TensorParallelMuon`` and
``get_megatron_muon_optimizer`` run as written.

The math: momentum ``m <- beta m + (1 - beta) g`` (Nesterov: ``(1 - beta) g + beta m``), weight
decay decoupled (``p <- p (1 - lr wd)``), independent (``p (1 - wd)``) or L2 (``g + wd p``), the
update orthogonalised by a Newton-Schulz iteration ``X <- a X + (b A + c A^2) X``, ``A = X X^T``,
from ``X = G / ||G||_F`` (the wider side kept as columns), scaled by the layer's shape, then
``p <- p - lr u``. At float32 matmul precision "medium" (Megatron's default) the iteration runs
in bfloat16 as ``torch.optim.Muon`` does: cast, then normalise (v0.1.0 normalises in float32
first; the two differ by bfloat16 rounding).
"""

from __future__ import annotations

import contextlib
import math
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

COEFFICIENTS: dict[str, list[tuple[float, float, float]]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}


def get_muon_scale_factor(size_out: int, size_in: int, mode: str = "spectral") -> float:
    """The factor an orthogonalised update of an ``size_out x size_in`` matrix is scaled by."""
    if mode == "spectral":
        return math.sqrt(max(size_out, size_in))
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, size_out / size_in))
    if mode == "unit_rms_norm":
        return math.sqrt(size_out / size_in)
    raise ValueError(f"unknown Muon scale mode {mode!r}: spectral, shape_scaling, unit_rms_norm")


def _coefficients(kind: str, steps: int, custom: list | None) -> list[tuple[float, float, float]]:
    sets = custom if kind == "custom" else COEFFICIENTS.get(kind)
    if not sets:
        raise ValueError(f"unknown Newton-Schulz coefficients {kind!r}: {sorted(COEFFICIENTS)}")
    if steps % len(sets):
        raise ValueError(f"{kind} Newton-Schulz needs a multiple of {len(sets)} steps, not {steps}")
    return [sets[i % len(sets)] for i in range(steps)]


def _summed(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``t`` summed over ``group`` (in float32: gloo reduces no bfloat16)."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    full = t.float()
    dist.all_reduce(full, group=group)
    return full.to(t.dtype)


def newton_schulz(
    x: torch.Tensor,
    steps: int,
    coefficient_type: str = "quintic",
    custom_coefficient_sets: list | None = None,
    eps: float = 1e-7,
    transpose: bool | None = None,
    tp_group: Any = None,
    use_syrk: bool = False,
) -> torch.Tensor:
    """The orthogonalised ``x`` [out, in] (float32); with ``tp_group`` ``x`` is this rank's
    shard of a matrix split along the side that is not transposed to the rows."""
    if x.ndim != 2 or x.dtype != torch.float32:
        raise ValueError(f"Newton-Schulz takes a float32 matrix, not {x.dtype} {tuple(x.shape)}")
    flip = x.size(0) > x.size(1) if transpose is None else transpose
    low = torch.get_float32_matmul_precision() == "medium"
    X = x.bfloat16() if low else x
    X = X.T if flip else X
    if tp_group is None:
        X = X / X.norm().clamp(min=eps)
    else:  # the whole matrix's Frobenius norm
        X = X / _summed(X.float().square().sum(), tp_group).sqrt().clamp(min=eps).to(X.dtype)
    for a, b, c in _coefficients(coefficient_type, steps, custom_coefficient_sets):
        gram = _summed(X @ X.T, tp_group)
        X = torch.addmm(X, torch.addmm(gram, gram, gram, beta=b, alpha=c), X, beta=a)
    X = X.T if flip else X
    return X.float()


def newton_schulz_tp(
    x: torch.Tensor,
    steps: int,
    coefficient_type: str,
    tp_group: Any,
    partition_dim: int | None = None,
    mode: str = "duplicated",
) -> torch.Tensor:
    """Newton-Schulz of a tensor-parallel shard: the whole matrix's result, this rank's part.
    ``duplicated`` gathers the matrix and iterates on it whole; ``distributed`` iterates on
    the shard, summing the Gram matrix and the norm over ``tp_group``."""
    if partition_dim is None or tp_group is None or dist.get_world_size(tp_group) == 1:
        return newton_schulz(x, steps, coefficient_type)
    n, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if mode == "duplicated":
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=tp_group)
        whole = newton_schulz(torch.cat(parts, dim=partition_dim), steps, coefficient_type)
        return whole.chunk(n, dim=partition_dim)[rank].contiguous()
    if mode == "distributed":
        if partition_dim not in (0, 1):
            raise ValueError(f"distributed Newton-Schulz splits dim 0 or 1, not {partition_dim}")
        return newton_schulz(
            x, steps, coefficient_type, transpose=partition_dim == 0, tp_group=tp_group
        )
    raise ValueError(f"unknown tensor-parallel Newton-Schulz mode {mode!r}")


@contextlib.contextmanager
def fp32_matmul_precision(precision: str) -> Iterator[None]:
    """torch's float32 matmul precision set to ``precision`` ("low" counts as "medium")."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium" if precision == "low" else precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class OrthogonalizedOptimizer(torch.optim.Optimizer):
    """Momentum SGD whose update is orthogonalised (Muon's family) before the step."""

    def __init__(
        self,
        params: Any,
        lr: float,
        momentum_beta: float,
        weight_decay: float,
        *,
        use_nesterov: bool,
        weight_decay_method: str,
        fp32_matmul_prec: str,
        scaled_orthogonalize_fn: Callable[..., torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        if weight_decay_method not in ("decoupled", "independent", "l2"):
            raise ValueError(f"unknown weight decay method {weight_decay_method!r}")
        defaults = dict(lr=lr, momentum_beta=momentum_beta, weight_decay=weight_decay, **kwargs)
        super().__init__(params, defaults)
        self.use_nesterov = use_nesterov
        self.weight_decay_method = weight_decay_method
        self.fp32_matmul_prec = fp32_matmul_prec
        self.scaled_orthogonalize_fn = scaled_orthogonalize_fn or (lambda g: g)

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.scaled_orthogonalize_fn(grad)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, beta = group["lr"], group["weight_decay"], group["momentum_beta"]
            extra = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() == 1:
                    raise ValueError("an orthogonalized optimizer takes matrices, not vectors")
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                if wd and self.weight_decay_method == "decoupled":
                    p.mul_(1 - lr * wd)
                elif wd and self.weight_decay_method == "independent":
                    p.mul_(1 - wd)
                elif wd:
                    g = g.add(p, alpha=wd)
                m = state["momentum_buffer"]
                m.lerp_(g, 1 - beta)
                u = g.lerp(m, beta) if self.use_nesterov else m
                with fp32_matmul_precision(self.fp32_matmul_prec):
                    u = self.orthogonalize(p, u, **extra)
                p.add_(u, alpha=-lr)
        return loss


def _real_package() -> bool:
    """Whether an ``emerging_optimizers`` with the interface Megatron calls imports."""
    try:
        from emerging_optimizers import orthogonalized_optimizers  # type: ignore[import-not-found]  # noqa: F401
        from emerging_optimizers.orthogonalized_optimizers import muon_utils  # type: ignore[import-not-found]
    except Exception:  # absent, or its Triton import fails
        return False
    import inspect

    return "mode" in inspect.signature(muon_utils.newton_schulz_tp).parameters


def install() -> bool:
    """Register this module as ``emerging_optimizers`` where the real one does not import
    (re-importing Megatron's Muon if it was imported without it); whether it did."""
    if getattr(sys.modules.get("emerging_optimizers"), "ANYSPEED_FALLBACK", False):
        return True
    if _real_package():
        return False
    top = types.ModuleType("emerging_optimizers")
    orth = types.ModuleType("emerging_optimizers.orthogonalized_optimizers")
    utils = types.ModuleType("emerging_optimizers.orthogonalized_optimizers.muon_utils")
    top.ANYSPEED_FALLBACK = True  # type: ignore[attr-defined]
    top.orthogonalized_optimizers = orth  # type: ignore[attr-defined]
    orth.OrthogonalizedOptimizer = OrthogonalizedOptimizer  # type: ignore[attr-defined]
    orth.get_muon_scale_factor = get_muon_scale_factor  # type: ignore[attr-defined]
    orth.muon_utils = utils  # type: ignore[attr-defined]
    utils.newton_schulz = newton_schulz  # type: ignore[attr-defined]
    utils.newton_schulz_tp = newton_schulz_tp  # type: ignore[attr-defined]
    sys.modules.update({m.__name__: m for m in (top, orth, utils)})
    muon = sys.modules.get("megatron.core.optimizer.muon")
    if muon is not None and not muon.HAVE_EMERGING_OPTIMIZERS:
        import importlib

        importlib.reload(muon)
    return True
