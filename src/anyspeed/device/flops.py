"""Peak matmul FLOP/s of the device, the denominator of MFU.

Order of precedence: ``ANYSPEED_PEAK_TFLOPS`` (configured), the datasheet figure of a known
accelerator, the on-disk cache, and finally a short matmul measurement whose result is cached
under ``~/.cache/anyspeed/peak_flops.json`` (keyed by device name, CPU capability, dtype and
thread count: an AVX2-only CPU and an AVX512-BF16 one of the same name differ 60-fold in bf16).
On a CPU only bursts in which the process had its cores to itself count: a peak measured while
other work ran would be low and inflate MFU (52-84% for a hidden-64 model), so a machine busy
throughout gives no peak and no MFU, and nothing is cached. Its cores are those the product
keeps busy, counted from its threads' CPU times (oneDNN's AMX bf16 product keeps one of two
busy: counted against two, an idle machine looked busy and bf16 MFU was never shown).
:class:`Peak` says where it came from.

A measured peak is the best rate over the run's dtype *and* fp32: half-precision work also runs
on fp32 units (on a CPU without bf16 matmul kernels much of a bf16 step does), so the dtype's own
rate alone understates what the device does and MFU came out above 100%.
:func:`slow_precision_warning` says when the dtype's matmul is far slower than fp32's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from anyspeed.device import detect, torch_device

# Dense (no sparsity) tensor-core peaks from vendor datasheets, TFLOP/s, bf16/fp16.
_DATASHEET_BF16 = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "B200": 2250.0,
}


def _cache_path() -> Path:
    root = os.environ.get("ANYSPEED_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "anyspeed"
    )
    return Path(root) / "peak_flops.json"


SLOW_RATIO = 4.0  # a half-precision matmul this many times slower than fp32 gets a warning
# A CPU burst counts when the process's threads ran for at least this share of its wall time;
# alone they run ~100%, beside one busy process per core ~50%.
FREE_SHARE = 0.85


@dataclass(frozen=True)
class Peak:
    """MFU's denominator for one process, FLOP/s (None: unknown, no MFU), and its origin."""

    flops: float | None
    source: str


def _key(dtype: torch.dtype) -> str:
    info = detect()
    threads = torch.get_num_threads() if info.is_cpu else 0
    isa = f"|{torch.backends.cpu.get_cpu_capability()}" if info.is_cpu else ""
    name = str(dtype).removeprefix("torch.")
    return f"{info.type}|{info.name}{isa}|{name}|threads={threads}|uncontended"


def measure_matmul_flops(dtype: torch.dtype, n: int = 1024, seconds: float = 0.5) -> float | None:
    """Measure sustained square-matmul FLOP/s on this device for ``dtype``: the best burst in
    which (on a CPU) the process had its cores to itself; None when no burst did, or when
    other work held part of the cores over the whole measurement.

    A dtype without fast kernels (bf16 on an AVX2 CPU: ~10 s per 1024^2 product) is measured
    on 256^2 matrices, so the measurement stays near ``seconds``.
    """
    dev = torch_device()
    sync = getattr(getattr(torch, dev.type, None), "synchronize", lambda: None)
    small = torch.randn(256, 256, device=dev).to(dtype)
    small @ small  # the first product pays for library and kernel set-up
    sync()
    start = time.perf_counter()
    small @ small
    sync()
    if (time.perf_counter() - start) * (n / 256) ** 3 > seconds / 4:
        n = 256
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    a @ b
    sync()
    # The best of several short bursts, not one long average: on a shared machine another
    # process's burst only spoils the bursts it overlaps, and a cached peak lasts.
    cores = torch.get_num_threads() if dev.type == "cpu" else 0
    if cores > 1:
        cores, n, a, b = _all_threads(cores, n, a, b, seconds)
    best, begin, cpu_begin = None, time.perf_counter(), time.process_time()
    while time.perf_counter() - begin < seconds:
        iters, start, cpu = 0, time.perf_counter(), time.process_time()
        while True:
            a @ b
            iters += 1
            if iters % 4 == 0 or dev.type == "cpu":
                sync()
                elapsed = time.perf_counter() - start
                if elapsed >= seconds / 8:
                    break
        if cores and time.process_time() - cpu < FREE_SHARE * cores * elapsed:
            continue  # other work had part of the cores: the rate would understate the peak
        best = max(best or 0.0, 2.0 * n**3 * iters / elapsed)
    if cores and time.process_time() - cpu_begin < FREE_SHARE * cores * (
        time.perf_counter() - begin
    ):
        return None  # busy throughout: a lucky burst is no evidence of the free rate
    return best


def _thread_ticks() -> dict[int, int] | None:
    """CPU clock ticks (user + system) of each thread of this process; None off Linux."""
    ticks = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name
            ticks[int(tid)] = int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, IndexError, ValueError):
        return None
    return ticks


def busy_threads(fn: Callable[[], object], seconds: float = 0.1) -> int | None:
    """How many of this process's threads ``fn``, called for ``seconds``, keeps busy: those
    with at least 30% of the busiest one's CPU time (contention slows them all alike, so the
    count holds on a shared machine); None where threads' times cannot be read."""
    before = _thread_ticks()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
    after = _thread_ticks()
    if before is None or after is None:
        return None
    spent = [t - before.get(tid, 0) for tid, t in after.items()]
    top = max(spent, default=0)
    return sum(s >= 0.3 * top for s in spent) if top > 0 else None


def _all_threads(
    cores: int, n: int, a: torch.Tensor, b: torch.Tensor, seconds: float
) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """The threads the CPU product ``a @ b`` keeps busy, its size and operands: one that keeps
    fewer than ``cores`` busy is tried at up to 4x the size while a product stays within
    1/128 of ``seconds`` (oneDNN runs a 1024^2 AMX bf16 product on one thread of two at 1.3
    TFLOP/s, a 2048^2 one on both at 2.3). The threads the last one keeps busy are its cores."""
    used = busy_threads(lambda: a @ b) or cores
    while used < cores and n < 4096:
        start = time.perf_counter()
        a @ b
        if (time.perf_counter() - start) * 8 > seconds / 16:  # the next size: 8x the work
            break
        n *= 2
        a, b = torch.randn(n, n).to(a.dtype), torch.randn(n, n).to(a.dtype)
        a @ b
        used = busy_threads(lambda x=a, y=b: x @ y) or cores
    return min(cores, used), n, a, b


def _datasheet(dtype: torch.dtype) -> float | None:
    """``ANYSPEED_PEAK_TFLOPS`` or a known accelerator's half-precision datasheet peak."""
    env = os.environ.get("ANYSPEED_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    info = detect()
    if info.is_cuda and dtype in (torch.bfloat16, torch.float16):
        for key, tf in _DATASHEET_BF16.items():
            if key in info.name:
                return tf * 1e12
    return None


def peak(dtype: torch.dtype = torch.bfloat16) -> Peak:
    """This process's peak FLOP/s for ``dtype``: configured, datasheet, or the best measured
    (cached) matmul rate of ``dtype`` and fp32; unknown when the machine was busy throughout."""
    env = os.environ.get("ANYSPEED_PEAK_TFLOPS")
    known = _datasheet(dtype)
    if known is not None:
        sheet = f"the {detect().name} datasheet's dense half-precision peak"
        return Peak(known, "ANYSPEED_PEAK_TFLOPS" if env else sheet)
    dtypes = [dtype] if dtype == torch.float32 else [dtype, torch.float32]
    rates = {d: matmul_rate(d) for d in dtypes}
    info = detect()
    where = f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    where = f"this {info.type} ({where})" if info.is_cpu else info.name
    if any(r is None for r in rates.values()):
        return Peak(
            None,
            f"unknown: {where} was busy with other work throughout its matmul measurement "
            "(nothing cached; rerun on an idle machine or set ANYSPEED_PEAK_TFLOPS)",
        )
    best = max(rates, key=lambda d: rates[d] or 0.0)
    name = str(best).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp")
    return Peak(
        rates[best], f"the best {name} matmul rate measured on {where}, cached in {_cache_path()}"
    )


def peak_flops(dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Peak FLOP/s for ``dtype`` on this device (see :func:`peak`); None when unknown."""
    return peak(dtype).flops


def slow_precision_warning(dtype: torch.dtype) -> str | None:
    """One line when ``dtype``'s matmul runs over :data:`SLOW_RATIO` times slower than fp32's
    here (measured; None on a datasheet device, for fp32, or when it is not slower)."""
    if dtype == torch.float32 or _datasheet(dtype) is not None:
        return None
    slow, fp32 = matmul_rate(dtype), matmul_rate(torch.float32)
    if slow is None or fp32 is None or fp32 <= SLOW_RATIO * slow:
        return None
    info = detect()
    where = f"{info.type} ({torch.backends.cpu.get_cpu_capability()})" if info.is_cpu else info.name
    name = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float16", "fp16")
    return (
        f"{name} matmuls on this {where} run {fp32 / slow:.0f}x slower than fp32 "
        f"({slow / 1e9:.2g} vs {fp32 / 1e9:.3g} GFLOP/s measured): training will crawl; "
        f"drop --{name} to train in fp32"
    )


def matmul_rate(dtype: torch.dtype) -> float | None:
    """This device's measured square-matmul FLOP/s for ``dtype`` (cached on disk); None, and
    nothing cached, when the machine was too busy to measure it."""
    path, key = _cache_path(), _key(dtype)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return float(cache[key])
    value = measure_matmul_flops(dtype)
    if value is None:
        return None
    cache[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return value
