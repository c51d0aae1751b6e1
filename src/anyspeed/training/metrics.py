"""Training metrics: peak memory, the progress line and TensorBoard scalars."""

from __future__ import annotations

import sys
import time


def peak_memory_bytes() -> int:
    """Peak memory of this process on its device (RSS high-water mark on CPU)."""
    from anyspeed.device import cpu_cuda, detect

    info = detect()
    if info.is_cpu:
        return cpu_cuda.max_memory_allocated()
    mod = getattr(__import__("torch"), info.type, None)
    fn = getattr(mod, "max_memory_allocated", None)
    return int(fn()) if fn else 0


def format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Progress:
    """A one-line progress bar on a terminal (stderr); a ``[i/N pct ETA]`` tag otherwise."""

    def __init__(self, total: int, start: int, enabled: bool = True) -> None:
        self.total, self.start = total, start
        self.t0 = time.perf_counter()
        self.tty = enabled and sys.stderr.isatty()

    def tag(self, it: int) -> str:
        done = it - self.start
        rate = (time.perf_counter() - self.t0) / max(done, 1)
        pct = 100.0 * it / max(self.total, 1)
        return f"[{it}/{self.total} {pct:3.0f}% ETA {format_eta(rate * (self.total - it))}]"

    def update(self, it: int) -> None:
        if not self.tty:
            return
        width = 30
        fill = int(width * it / max(self.total, 1))
        sys.stderr.write(f"\r|{'#' * fill}{'.' * (width - fill)}| {self.tag(it)} ")
        sys.stderr.flush()

    def clear(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + " " * 70 + "\r")
            sys.stderr.flush()


class TensorBoard:
    """Scalars to TensorBoard event files (``--tensorboard-dir``), written by one rank."""

    def __init__(self, directory: str | None) -> None:
        self.writer = None
        if directory:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # the tensorboard package is optional
                raise RuntimeError(
                    "--tensorboard-dir needs the tensorboard package (pip install tensorboard)"
                ) from exc
            self.writer = SummaryWriter(log_dir=directory, max_queue=100)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
