"""Peak matmul FLOP/s of the device, the denominator of MFU.

Order of precedence: ``ANYSPEED_PEAK_TFLOPS`` (configured), the datasheet figure of a known
accelerator, the on-disk cache, and finally a short matmul measurement whose result is cached
under ``~/.cache/anyspeed/peak_flops.json`` (keyed by device name, dtype and thread count).
"""

from __future__ import annotations

import json
import os
import time
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


def _key(dtype: torch.dtype) -> str:
    info = detect()
    threads = torch.get_num_threads() if info.is_cpu else 0
    return f"{info.type}|{info.name}|{str(dtype).removeprefix('torch.')}|threads={threads}"


def measure_matmul_flops(dtype: torch.dtype, n: int = 1024, seconds: float = 0.5) -> float:
    """Measure sustained square-matmul FLOP/s on this device for ``dtype``."""
    dev = torch_device()
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    sync = getattr(getattr(torch, dev.type, None), "synchronize", lambda: None)
    for _ in range(2):
        a @ b
    sync()
    iters, start = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        if iters % 4 == 0:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
    return 2.0 * n**3 * iters / elapsed


def peak_flops(dtype: torch.dtype = torch.bfloat16) -> float:
    """Peak FLOP/s for ``dtype`` on this device (configured, datasheet, cached or measured)."""
    env = os.environ.get("ANYSPEED_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    info = detect()
    if info.is_cuda and dtype in (torch.bfloat16, torch.float16):
        for key, tf in _DATASHEET_BF16.items():
            if key in info.name:
                return tf * 1e12
    path, key = _cache_path(), _key(dtype)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return float(cache[key])
    value = measure_matmul_flops(dtype)
    cache[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return value
