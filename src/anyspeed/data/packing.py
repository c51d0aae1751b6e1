"""Packing of instruction samples into fixed-length sequences (best-fit decreasing, per window)."""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

from anyspeed.data.handlers import IGNORE_INDEX, Sample


def plan_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group sample indices into bins of total length <= capacity; never splits a sample.

    Longest first, each into the fullest bin that still fits it (a greedy knapsack); members
    of a bin keep their input order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id)
    bins: list[list[int]] = []
    for i in order:
        size = lengths[i]
        if size > capacity:
            raise ValueError(f"sample of length {size} exceeds capacity {capacity}")
        j = bisect_left(free, (size, -1))
        if j < len(free):
            room, b = free.pop(j)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        insort(free, (room - size, b))
    return [sorted(b) for b in bins]


class Packer:
    """Buffers up to ``window`` samples, then emits them packed to exactly ``seq_length``."""

    def __init__(self, seq_length: int, window: int, pad_id: int, neat: bool = False) -> None:
        self.seq_length = seq_length
        self.window = window
        self.pad_id = pad_id
        self.neat = neat
        self.buffer: list[Sample] = []

    def add(self, samples: list[Sample]) -> list[Sample]:
        """Queue samples; returns packed sequences whenever a window fills."""
        out: list[Sample] = []
        for s in samples:
            self.buffer.append(s)
            if len(self.buffer) >= self.window:
                out += self.flush()
        return out

    def flush(self) -> list[Sample]:
        """Pack whatever is buffered."""
        samples, self.buffer = self.buffer, []
        bins = plan_bins([len(s["input_ids"]) for s in samples], self.seq_length)
        return [self._build([samples[i] for i in b]) for b in bins]

    def _build(self, members: list[Sample]) -> Sample:
        pad = self.seq_length - sum(len(m["input_ids"]) for m in members)
        ids = [m["input_ids"] for m in members] + [np.full(pad, self.pad_id, np.int64)]
        labels = [m["labels"] for m in members] + [np.full(pad, IGNORE_INDEX, np.int64)]
        if self.neat:  # segment ids 1, 2, 3, ... mark sample boundaries; padding is 0
            mask = [np.full(len(m["input_ids"]), k, np.int64) for k, m in enumerate(members, 1)]
        else:
            mask = [np.ones(len(m["input_ids"]), np.int64) for m in members]
        mask.append(np.zeros(pad, np.int64))
        return {
            "input_ids": np.concatenate(ids),
            "labels": np.concatenate(labels),
            "attention_mask": np.concatenate(mask),
        }
