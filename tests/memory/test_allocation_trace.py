"""The allocation trace (measured tensor memory) against tensors of known sizes."""

from __future__ import annotations

import torch

from anyspeed.features.memory.trace import AllocationTrace


def test_live_bytes_and_peak_follow_allocations_and_frees():
    before = torch.empty(5000)  # allocated before the trace: its free must not count
    with AllocationTrace() as trace:
        kept = torch.empty(1000)  # 4000 bytes
        trace.mark("kept")
        temp = torch.empty(2000, dtype=torch.float64)  # 16000 bytes
        del temp, before
        trace.mark("freed")
        more = torch.empty(10, dtype=torch.int8)
        trace.mark("end")
    assert trace.live_at("kept") == kept.nbytes == 4000
    assert trace.peak("kept", "freed") == 4000 + 16000
    assert trace.live_at("freed") == 4000
    assert trace.live_at("end") == 4000 + more.nbytes
    assert trace.peak() == 20000


def test_held_bytes_leave_out_blocks_freed_on_another_thread():
    """A block whose last reference drops on another thread (as gloo's worker threads drop a
    collective's tensors): the profiler misses the free, so ``live_at`` still counts it, and
    ``held_at`` counts only what reachable tensors hold."""
    import threading

    with AllocationTrace() as trace:
        kept = torch.empty(1000)
        box = [torch.empty(3000)]
        worker = threading.Thread(target=box.clear)
        worker.start()
        worker.join()
        trace.mark("after")
    assert trace.held_at("after") == kept.nbytes
    assert trace.live_at("after") == kept.nbytes + 12000  # the profiler's view: a missed free
