"""The ``torch.cuda`` surface Megatron uses, implemented for the CPU.

Each process owns one virtual device whose index is what ``set_device`` was last given. The
"device" RNG is the CPU default generator (CPU kernels such as dropout draw from it), so
Megatron's RNG tracker fork/restore keeps its meaning. Memory statistics report the process's
resident set (current, and a resettable peak through ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

_state = {"index": 0}


# ------------------------------------------------------------------ device index
def current_device() -> int:
    return _state["index"]


def set_device(device: Any) -> None:
    if isinstance(device, torch.device):
        device = device.index or 0
    elif isinstance(device, str):
        device = int(device.split(":")[1]) if ":" in device else 0
    _state["index"] = int(device)


def device_count() -> int:
    # One virtual device per local process, so ``local_rank < device_count()`` checks hold.
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    return None


def _lazy_call(callable: Callable[[], Any], **kwargs: Any) -> None:  # noqa: A002
    # There is nothing to initialise lazily on the CPU: run the callback now.
    callable()


class device:  # noqa: N801 - mirrors torch.cuda.device
    """Context manager that selects a virtual device index (nothing to switch on the CPU)."""

    def __init__(self, device: Any) -> None:
        self.idx = device

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def device_of(obj: Any) -> device:
    return device(0)


# ------------------------------------------------------------------ RNG
class _Generators(tuple):
    """``torch.cuda.default_generators``: every virtual device index maps to the CPU generator."""

    def __getitem__(self, idx):  # type: ignore[override]
        if isinstance(idx, slice):
            return tuple(torch.default_generator for _ in range(device_count()))[idx]
        return torch.default_generator

    def __len__(self) -> int:
        return device_count()

    def __iter__(self):
        return iter([torch.default_generator] * device_count())


default_generators = _Generators((torch.default_generator,))


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [torch.get_rng_state()]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    torch.set_rng_state(new_states[0])


def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


manual_seed_all = manual_seed


def seed() -> None:
    torch.default_generator.seed()


seed_all = seed


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


# ------------------------------------------------------------------ streams and events
class Stream:
    """A CPU 'stream': work runs in program order, so every wait is already satisfied."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream: Stream) -> None:
        return None

    def wait_event(self, event: Event) -> None:
        return None

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    @property
    def cuda_stream(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream)

    def __hash__(self) -> int:
        return 0


_default_stream = Stream()
_stream_stack: list[Stream] = [_default_stream]


class Event:
    """A CPU event: records the wall clock so ``elapsed_time`` gives real milliseconds."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **kwargs: Any) -> None:
        self._t: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: Event) -> float:
        if self._t is None or end_event._t is None:
            raise RuntimeError("Event.elapsed_time: both events must be recorded first")
        return (end_event._t - self._t) * 1000.0


def current_stream(device: Any = None) -> Stream:
    return _stream_stack[-1]


def default_stream(device: Any = None) -> Stream:
    return _default_stream


def set_stream(stream: Stream) -> None:
    _stream_stack[-1] = stream


@contextlib.contextmanager
def stream(stream: Stream | None) -> Iterator[None]:
    if stream is None:
        yield
        return
    _stream_stack.append(stream)
    try:
        yield
    finally:
        _stream_stack.pop()


def synchronize(device: Any = None) -> None:
    return None


# ------------------------------------------------------------------ memory
def _proc_kib(path: str, key: str) -> int:
    """The ``key:`` value (KiB) of a /proc file such as /proc/self/status; 0 when absent."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _status_kib(key: str) -> int:
    return _proc_kib("/proc/self/status", key)


def memory_allocated(device: Any = None) -> int:
    """Current resident set size of this process, in bytes."""
    rss = _status_kib("VmRSS")
    if rss:
        return rss * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def max_memory_allocated(device: Any = None) -> int:
    """Peak resident set size since the last reset, in bytes."""
    hwm = _status_kib("VmHWM")
    if hwm:
        return hwm * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


memory_reserved = memory_allocated
max_memory_reserved = max_memory_allocated


def reset_peak_memory_stats(device: Any = None) -> None:
    # Writing 5 to clear_refs resets the kernel's peak-RSS counter (VmHWM) for this process.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


reset_max_memory_allocated = reset_peak_memory_stats
reset_max_memory_cached = reset_peak_memory_stats


def memory_stats(device: Any = None) -> dict[str, int]:
    cur, peak = memory_allocated(), max_memory_allocated()
    return {
        "allocated_bytes.all.current": cur,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": cur,
        "reserved_bytes.all.peak": peak,
        "active_bytes.all.current": cur,
        "active_bytes.all.peak": peak,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    cur, peak = memory_allocated(), max_memory_allocated()
    return f"CPU process memory: resident {cur / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB"


def _meminfo_kib(key: str) -> int:
    return _proc_kib("/proc/meminfo", key)


def mem_get_info(device: Any = None) -> tuple[int, int]:
    return _meminfo_kib("MemAvailable") * 1024, _meminfo_kib("MemTotal") * 1024


def empty_cache() -> None:
    return None


def ipc_collect() -> None:
    return None


# ------------------------------------------------------------------ properties
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def get_device_name(device: Any = None) -> str:
    return _cpu_name()


def get_device_capability(device: Any = None) -> tuple[int, int]:
    return (0, 0)


def get_device_properties(device: Any = None) -> SimpleNamespace:
    return SimpleNamespace(
        name=_cpu_name(),
        total_memory=_meminfo_kib("MemTotal") * 1024,
        multi_processor_count=torch.get_num_threads(),
        major=0,
        minor=0,
        is_integrated=True,
        uuid="cpu",
        gcnArchName="",  # read by Inductor (torch.version.cuda is None in a CPU build)
    )


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_arch_list() -> list[str]:
    return []


# ------------------------------------------------------------------ nvtx
def _nvtx_push(msg: str) -> int:
    return 0


def _nvtx_pop() -> int:
    return 0


def _nvtx_mark(msg: str) -> None:
    return None


@contextlib.contextmanager
def _nvtx_range(msg: str, *args: Any, **kwargs: Any) -> Iterator[None]:
    yield


nvtx = SimpleNamespace(
    range_push=_nvtx_push, range_pop=_nvtx_pop, mark=_nvtx_mark, range=_nvtx_range
)
