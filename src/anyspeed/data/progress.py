"""Throttled progress line (docs/s, tokens/s, MB/s, ETA) and the closing summary on stderr."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO


def _human(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}T"


def _duration(s: float) -> str:
    s = int(s)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


@dataclass
class Stats:
    """Counts gathered over a run (merged across partitions)."""

    records: int = 0
    samples: int = 0
    packs: int = 0
    tokens: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    outputs: dict[str, int] = field(default_factory=dict)
    input_bytes: int = 0
    seconds: float = 0.0

    def skip(self, source: str, line: int, reason: str, detail: str, keep: int = 10) -> str:
        """Count one skipped record and remember the first few messages."""
        self.skipped[reason] += 1
        msg = f"{source}:{line}: {reason}" + (f" ({detail})" if detail else "")
        if len(self.examples) < keep:
            self.examples.append(msg)
        return msg

    def merge(self, other: Stats) -> None:
        """Add another run's counts into this one."""
        self.records += other.records
        self.samples += other.samples
        self.packs += other.packs
        self.tokens += other.tokens
        self.skipped.update(other.skipped)
        self.examples.extend(other.examples[: max(0, 10 - len(self.examples))])
        self.input_bytes += other.input_bytes


class Progress:
    """Prints a rate line to stderr at most every ``every`` seconds (live on a terminal)."""

    def __init__(self, total_bytes: int, enabled: bool = True, stream: TextIO | None = None):
        self.total = total_bytes
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.every = 0.5 if self.tty else 10.0
        self.start = time.monotonic()
        self.last = self.start
        self.shown = False

    def update(self, stats: Stats, done_bytes: int, force: bool = False) -> None:
        """Redraw if enough time has passed (or ``force``)."""
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < self.every):
            return
        self.last = now
        dt = max(now - self.start, 1e-9)
        line = (
            f"{_human(stats.records)} docs {_human(stats.records / dt)}/s | "
            f"{_human(stats.tokens)} tok {_human(stats.tokens / dt)}/s | "
            f"{done_bytes / 1e6:.1f} MB {done_bytes / 1e6 / dt:.1f} MB/s"
        )
        if self.total and 0 < done_bytes < self.total:
            eta = (self.total - done_bytes) / (done_bytes / dt)
            line += f" | {100 * done_bytes / self.total:.0f}% ETA {_duration(eta)}"
        if stats.skipped:
            line += f" | skipped {sum(stats.skipped.values())}"
        self.stream.write(("\r\x1b[K" if self.tty else "") + line + ("" if self.tty else "\n"))
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        """End the live line so the summary starts on a fresh line."""
        if self.enabled and self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()


def summary(stats: Stats) -> str:
    """Human-readable closing report."""
    dt = max(stats.seconds, 1e-9)
    lines = [
        f"anyspeed preprocess: {stats.records} documents read, {stats.samples} written"
        + (f" in {stats.packs} packed sequences" if stats.packs else "")
        + f", {stats.tokens} tokens, {stats.input_bytes / 1e6:.1f} MB in {stats.seconds:.1f}s "
        f"({stats.records / dt:.0f} docs/s, {stats.tokens / dt:.0f} tok/s, "
        f"{stats.input_bytes / 1e6 / dt:.1f} MB/s)",
    ]
    total = sum(stats.skipped.values())
    if total:
        why = ", ".join(f"{reason}: {n}" for reason, n in stats.skipped.most_common())
        lines.append(f"  skipped {total} ({why})")
        lines += [f"    {msg}" for msg in stats.examples]
        if total > len(stats.examples):
            lines.append(f"    ... and {total - len(stats.examples)} more")
    for path, size in stats.outputs.items():
        lines.append(f"  wrote {path} ({size / 1e6:.2f} MB)")
    return "\n".join(lines)
