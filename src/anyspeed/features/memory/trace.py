"""Measured tensor memory of a process: the allocator's running total, at marks and at its peak.

torch's profiler with ``profile_memory=True`` sees every allocation and free of the device's
tensor allocator (on the CPU, c10's CPU allocator reports them only while profiling) and
records each with its address and size. :class:`AllocationTrace` sums them into a running
total over time, so a test can read the live tensor bytes at a point of a run (after the
optimizer step: parameters, gradients, optimizer state) and the peak between two points (a
step: plus activations and transients).
Allocations made before the trace started are not counted, nor are their frees.
The profiler sees only frees on threads it runs on: a block whose last reference drops on a
collective's worker thread (gloo's) stays "live" in the trace. :meth:`held_at` counts only the
blocks a Python-reachable tensor still holds at a mark, which leaves such blocks out.
"""

from __future__ import annotations

import bisect
import gc

import torch

_MARK = "anyspeed.memory.mark:"
_ACTIVE: list[AllocationTrace] = []  # the traces running now: marks note their reachable blocks


def _reachable_blocks() -> set[int]:
    """Addresses of the storages every tensor Python can reach holds (after a collection)."""
    out = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(): no lazy module's __getattr__ runs
            try:
                out.add(obj.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # no storage: a meta or sparse tensor
                pass
    return out


class AllocationTrace:
    """Context manager: tensor bytes allocated on ``device`` (a type: ``cpu``, ``cuda``...)
    since it started, as a timeline; :meth:`mark` names points of it."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._prof: torch.profiler.profile | None = None
        self.times: list[int] = []  # allocation event times (ns), sorted
        self.totals: list[int] = []  # the allocator's running total after each event
        self.marks: dict[str, int] = {}
        self._reachable: dict[str, set[int]] = {}  # mark -> blocks reachable tensors hold
        self.held: dict[str, int] = {}  # mark -> traced live bytes in those blocks

    def __enter__(self) -> AllocationTrace:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        _ACTIVE.append(self)
        return self

    @staticmethod
    def mark(name: str) -> None:
        """Name this point of the run (read back with :meth:`live_at` and :meth:`peak`), after
        a garbage collection: unreachable reference cycles do not count as live."""
        gc.collect()
        if _ACTIVE:
            reachable = _reachable_blocks()
            for trace in _ACTIVE:
                trace._reachable[name] = reachable
        with torch.profiler.record_function(_MARK + name):
            pass

    def __exit__(self, *exc) -> None:
        assert self._prof is not None
        self._prof.__exit__(*exc)
        _ACTIVE.remove(self)
        events: list[tuple[int, int, int]] = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack += e.children
            fields = e.extra_fields
            if type(fields).__name__.endswith("Allocation"):
                if str(fields.device).split(":")[0] == self.device:
                    events.append((e.start_time_ns, fields.alloc_size, fields.ptr))
            elif e.name.startswith(_MARK):
                self.marks[e.name[len(_MARK) :]] = e.start_time_ns
        self._prof = None
        live: dict[int, int] = {}  # blocks allocated since the start -> bytes
        total = 0
        pending = sorted((t, name) for name, t in self.marks.items() if name in self._reachable)
        for t, size, ptr in sorted(events):  # at a tie, a free before an allocation
            while pending and pending[0][0] < t:
                name = pending.pop(0)[1]
                self.held[name] = sum(live.get(p, 0) for p in self._reachable.pop(name))
            if size < 0 and ptr not in live:
                continue  # allocated before the trace started
            total += size if size > 0 else -live.pop(ptr)
            if size > 0:
                live[ptr] = size
            self.times.append(t)
            self.totals.append(total)
        for _, name in pending:  # marks after the last event
            self.held[name] = sum(live.get(p, 0) for p in self._reachable.pop(name))

    def live_at(self, name: str) -> int:
        """Bytes allocated (and not freed) since the start, at mark ``name``."""
        i = bisect.bisect_right(self.times, self.marks[name])
        return self.totals[i - 1] if i else 0

    def held_at(self, name: str) -> int:
        """Of :meth:`live_at`'s bytes, those in blocks that tensors Python can reach held at mark
        ``name``: without blocks whose free the profiler missed."""
        return self.held[name]

    def peak(self, start: str | None = None, end: str | None = None) -> int:
        """The most bytes held at once between marks ``start`` and ``end`` (default: all)."""
        lo = bisect.bisect_right(self.times, self.marks[start]) if start else 0
        hi = bisect.bisect_right(self.times, self.marks[end]) if end else len(self.times)
        before = self.totals[lo - 1] if lo else 0
        return max([before, *self.totals[lo:hi]])
