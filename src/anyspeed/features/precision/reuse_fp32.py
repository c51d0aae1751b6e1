"""fp32 master weights kept as the bf16 model weight plus a 16-bit residual.

Megatron's bf16 optimizers (``Float16OptimizerWithFloat16Params`` and the distributed optimizer)
keep an fp32 master copy of every bf16 weight (or of this rank's shard): 4 bytes next to the 2 of
the model weight. The bf16 weight is the master rounded to nearest-even, so it already holds the
master's upper 16 bits up to a carry: the master is ``bf16 bits << 16`` plus a signed residual in
``[-2**15, 2**15]``. Only the residual is stored (2 bytes); the one value that does not fit an
int16 (``+2**15``, a tie rounded down to the even bf16) is kept as a sparse index list, so the
master is rebuilt exactly, bit for bit, and the bf16 weight stays what ``copy_`` (round to
nearest-even) gives, as on the regular path.

Between steps each master tensor's storage is released. The optimizer step rebuilds the masters
a chunk at a time, smallest tensors first (at most :data:`CHUNK_BYTES` of masters, or one tensor
if larger), steps only those parameters (elementwise optimizers: the same numbers as one whole
step), writes the bf16 weight and residual back, releases them and drops the chunk's (dead) fp32
gradient copies, which makes room for the next chunk. Checkpoint and reload methods see the masters
rebuilt (``live``) and in the usual format; the next step releases them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

CHUNK_BYTES = 64 * 2**20  # masters rebuilt at once during the step
_SLICE = 2**22  # elements per slice when computing residuals (bounds temporaries)
_TIE = 2**15

# Optimizer methods that read or write the masters: they run with the masters rebuilt.
LIVE_METHODS = (
    "state_dict",
    "sharded_state_dict",
    "load_state_dict",
    "get_parameter_state_dp_zero",
    "get_parameter_state_dp_reshardable",
    "save_parameter_state",
    "load_parameter_state",
    "load_parameter_state_from_dp_zero",
    "load_parameter_state_from_dp_reshardable",
    "load_parameter_state_from_fully_reshardable",
    "load_parameter_state_from_fs_model_space",
    "sharded_param_state_dp_zero",
    "sharded_param_state_fully_reshardable",
    "sharded_param_state_dp_reshardable",
    "sharded_param_state_fs_model_space",
)


def encode(master: torch.Tensor, model: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``master`` (fp32) into ``model`` (bf16, in place) and return ``(residual int16,
    flat indices whose residual is +2**15)``; ``master`` is used as scratch."""
    bits = master.view(torch.int32).view(-1)
    flat = model.view(-1)
    flat.copy_(master.view(-1))  # round to nearest-even, as Megatron's copy does
    residual = torch.empty(bits.numel(), dtype=torch.int16, device=bits.device)
    ties = []
    for start in range(0, bits.numel(), _SLICE):
        chunk = bits[start : start + _SLICE]
        chunk.sub_(flat[start : start + _SLICE].float().view(torch.int32))
        ties.append(torch.nonzero(chunk == _TIE).view(-1) + start)
        residual[start : start + _SLICE].copy_(chunk)  # +2**15 wraps to -2**15
    return residual, torch.cat(ties) if ties else torch.empty(0, dtype=torch.long)


def decode(
    model: torch.Tensor, residual: torch.Tensor, ties: torch.Tensor, out: torch.Tensor
) -> None:
    """Write the exact fp32 master of ``model`` + ``residual`` (+ ``ties``) into ``out``."""
    out.view(-1).copy_(model.view(-1))  # bf16 -> fp32 is exact: the upper 16 bits
    bits = out.view(torch.int32).view(-1)
    bits.add_(residual)
    if ties.numel():
        bits[ties] += 2 * _TIE


class ResidualMasters:
    """The (bf16 model tensor, fp32 master) pairs of one Megatron mixed-precision optimizer,
    with each master held as a residual while released."""

    def __init__(self, optimizer: Any, chunk_bytes: int | None = None) -> None:
        self.optimizer = optimizer
        self.chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        model, main = optimizer._get_model_and_main_params_data_float16()
        self.pairs = list(zip(model, main, strict=True))
        # the master tensors the inner optimizer holds (``main`` above are their ``.data``)
        groups = getattr(optimizer, "shard_fp32_from_float16_groups", None)
        if groups is None:
            groups = optimizer.fp32_from_float16_groups
        self.params = [p for g in groups for p in g]
        assert len(self.params) == len(self.pairs)
        self.residuals: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.pairs)
        self.live = True  # Megatron just built the masters
        self.release()

    def _release(self, i: int) -> None:
        model, main = self.pairs[i]
        self.residuals[i] = encode(main, model)
        main.untyped_storage().resize_(0)

    def _rebuild(self, i: int) -> None:
        model, main = self.pairs[i]
        main.untyped_storage().resize_(main.numel() * main.element_size())
        residual, ties = self.residuals[i]
        decode(model, residual, ties, main)
        self.residuals[i] = None

    def release(self) -> None:
        """Masters -> bf16 weights + residuals; the masters' storage is freed."""
        if self.live:
            for i in range(len(self.pairs)):
                self._release(i)
            self.live = False

    def rebuild(self) -> None:
        """Residuals -> exact fp32 masters (for checkpoints and reloads)."""
        if not self.live:
            for i in range(len(self.pairs)):
                self._rebuild(i)
            self.live = True

    def reset_from_model(self) -> None:
        """The masters become the bf16 weights exactly (Megatron's reload_model_params)."""
        self.rebuild()
        for model, main in self.pairs:
            main.copy_(model)

    def chunks(self) -> Iterator[list[int]]:
        """Pair indices, smallest tensors first, grouped so each group's masters take at most
        ``chunk_bytes`` (one tensor if bigger)."""
        group, size = [], 0
        for i in sorted(range(len(self.pairs)), key=lambda i: self.pairs[i][1].numel()):
            nbytes = self.pairs[i][1].numel() * 4
            if group and size + nbytes > self.chunk_bytes:
                yield group
                group, size = [], 0
            group.append(i)
            size += nbytes
        if group:
            yield group

    @torch.no_grad()
    def step(self, inner_step: Any) -> None:
        """The inner optimizer's step, a chunk of rebuilt masters at a time."""
        if self.live:  # after a load: the masters are already whole
            inner_step()
            self.release()
            return
        inner = self.optimizer.optimizer
        groups = inner.param_groups
        saved = [g["params"] for g in groups]
        reused = {id(p) for p in self.params}
        try:
            for n, chunk in enumerate(self.chunks()):
                ids = {id(self.params[i]) for i in chunk}
                for i in chunk:
                    self._rebuild(i)
                first = n == 0  # parameters without a master (fp32 ones) step with it
                for g, params in zip(groups, saved, strict=True):
                    g["params"] = [
                        p for p in params if id(p) in ids or (first and id(p) not in reused)
                    ]
                inner_step()
                for i in chunk:
                    self._release(i)
                    # the fp32 gradient copy is dead once stepped (Megatron drops it at the
                    # next zero_grad): freeing it makes room for the next chunk's masters
                    self.params[i].grad = None
        finally:
            for g, params in zip(groups, saved, strict=True):
                g["params"] = params


def install(optimizer: Any, chunk_bytes: int | None = None) -> ResidualMasters | None:
    """Hold ``optimizer``'s masters as residuals (bf16 only); returns the store, or None when
    there is nothing to do (fp32/fp16 training, a stub optimizer on a rank without params)."""
    if getattr(optimizer, "is_stub_optimizer", True) or not optimizer.config.bf16:
        return None
    if any(main is None for main in optimizer._get_model_and_main_params_data_float16()[1]):
        return None  # the precision-aware optimizer keeps its own masters
    store = ResidualMasters(optimizer, chunk_bytes)
    inner_step = optimizer.optimizer.step
    optimizer.optimizer.step = lambda *a, **k: store.step(functools.partial(inner_step, *a, **k))
    # step() above already wrote the bf16 weights; the copy would read released masters
    optimizer._copy_main_params_to_model_params = lambda: None
    optimizer._copy_model_params_to_main_params = _reload(store)
    for name in LIVE_METHODS:
        method = getattr(optimizer, name, None)
        if method is not None:
            setattr(optimizer, name, _with_live(store, method))
    optimizer.reuse_fp32_param = store
    return store


def _reload(store: ResidualMasters) -> Any:
    def _copy_model_params_to_main_params(state_dict: Any = None) -> None:
        assert state_dict is None, "--reuse-fp32-param: reload from a state dict is not supported"
        store.reset_from_model()

    return _copy_model_params_to_main_params


def _with_live(store: ResidualMasters, method: Any) -> Any:
    @functools.wraps(method)
    def live(*args: Any, **kwargs: Any) -> Any:
        store.rebuild()
        return method(*args, **kwargs)

    return live
