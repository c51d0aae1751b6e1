"""``--profile``: torch.profiler over a window of training steps on chosen ranks.

Megatron-LM's flags and window: ``--profile-step-start S --profile-step-end E`` profile the
steps that begin with S steps done and end with E done (steps S+1..E, 1-based), on the ranks
of ``--profile-ranks`` (default 0). Each profiled rank writes a Chrome trace
(``profile_rank{R}_steps{S+1}-{E}.json``, open it in Perfetto or chrome://tracing) to
``--tensorboard-dir``, else ``--save``, else none, and prints one line: the ops' time per step,
the share of it in matrix products (the figure that says whether a step is bound by its
products or by what surrounds them) and the top ops.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from anyspeed.training.loop import Hook, LoopState

# the ops that are matrix products (dense layers, attention's batched products, packed MKL)
PRODUCTS = frozenset(
    {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "mkl::_mkl_linear"}
)


def summarize(averages: Any, steps: int, on_device: bool) -> tuple[float, float, list]:
    """(ops' seconds per step, matrix products' share of them, [(op, seconds per step)] by
    time) from a profiler's ``key_averages()``: self times, on the device when it has one.

    On a device each operator's self time is that of the kernels it launched, and the kernels
    are listed again as events of their own; the total is theirs alone (as torch's own table
    sums it), so a kernel is counted once."""
    times: dict[str, float] = {}
    total = 0.0
    for e in averages:
        if not on_device:
            us = e.self_cpu_time_total
            total += max(us, 0) / 1e6 / steps
        elif _is_kernel(e):
            if not getattr(e, "is_user_annotation", False):  # a range, not work
                total += e.self_device_time_total / 1e6 / steps
            continue
        else:  # an operator: its own kernels' time
            us = e.self_device_time_total
        if us > 0:
            times[e.key] = times.get(e.key, 0.0) + us / 1e6 / steps
    products = sum(t for k, t in times.items() if k in PRODUCTS)
    ranked = sorted(times.items(), key=lambda kv: -kv[1])
    return total, (products / total if total else 0.0), ranked


def _is_kernel(e: Any) -> bool:
    """Whether a profiler event is the device's own (a kernel, a copy) rather than an
    operator on the CPU."""
    from torch.autograd import DeviceType

    return getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU


@contextlib.contextmanager
def _no_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: the profiler's C++ side prints a line to it on each
    start and stop (``USDT: ... profiler_start``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class ProfileHook(Hook):
    """Runs torch.profiler from step ``start + 1`` through step ``end`` on this rank."""

    def __init__(self, prog: str, start: int, end: int, out_dir: str | None) -> None:
        self.prog, self.start, self.end, self.out_dir = prog, start, end, out_dir
        self.prof: Any = None
        self.first = 0

    def before_step(self, state: LoopState) -> None:
        if self.prof is None and self.start <= state.iteration < self.end:
            import torch

            kinds = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available() and torch.version.cuda is not None:
                kinds.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=kinds, record_shapes=False)
            with _no_stderr():
                self.prof.__enter__()
            self.first = state.iteration + 1

    def after_step(self, state: LoopState, out: dict[str, Any]) -> None:
        if self.prof is not None and state.iteration >= self.end:
            self._finish(state.iteration)

    def on_end(self, state: LoopState, completed: bool) -> None:
        if self.prof is not None:
            self._finish(state.iteration)
        elif not self.first:  # e.g. a resumed run that started past the window
            print(
                f"{self.prog}: profile: no step in {self.start + 1}-{self.end} ran (this run "
                f"trained steps {state.start_iteration + 1}-{state.iteration})",
                flush=True,
            )

    def on_abort(self, state: LoopState) -> None:
        if self.prof is not None:
            with _no_stderr():
                self.prof.__exit__(None, None, None)
            self.prof = None

    def _finish(self, last: int) -> None:
        import torch

        prof, self.prof = self.prof, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        with _no_stderr():
            prof.__exit__(None, None, None)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        steps = last - self.first + 1
        averages = prof.key_averages()
        on_device = any(getattr(e, "self_device_time_total", 0) > 0 for e in averages)
        total, share, ranked = summarize(averages, steps, on_device)
        where = ""
        if self.out_dir:
            os.makedirs(self.out_dir, exist_ok=True)
            path = os.path.join(self.out_dir, f"profile_rank{rank}_steps{self.first}-{last}.json")
            prof.export_chrome_trace(path)
            where = f"; trace {path}"
        top = ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in ranked[:5])
        clock = "device" if on_device else "CPU"
        print(
            f"{self.prog}: profile of steps {self.first}-{last} on rank {rank}: "
            f"{total * 1e3:.1f} ms of ops ({clock} self time) per step, matrix products "
            f"{share:.1%} of it; top: {top}{where}",
            flush=True,
        )
