"""Samples of ``anyspeed fsdp2`` and the micro-batches each rank trains on.

Three sources, told apart by their files: a pretraining ``.bin/.idx`` prefix (the token stream
cut into windows of ``cutoff_len + 1``), an instruction dataset prefix (``anyspeed preprocess``
with an instruction handler; the loss on the answers), and a multimodal conversation JSON file
(:mod:`anyspeed.fsdp.mm_data`). A sample is its input tokens and next-token targets (-100
where nothing is learned). The data position is a count of samples, so a run resumed at another
number of ranks continues where it stopped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch

from anyspeed.errors import UsageError
from anyspeed.fsdp.samples import IGNORE, Sample, collate


class Source(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Sample: ...


class PretrainSource:
    """Windows of ``seq + 1`` tokens of a pretraining dataset's token stream (documents
    back to back, as written by ``anyspeed preprocess``)."""

    def __init__(self, prefix: str, seq: int) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.ds = IndexedDataset(prefix)  # owns the memory map the tokens view
        self.tokens = np.frombuffer(self.ds.bin_reader._bin_buffer_mmap, dtype=self.ds.index.dtype)
        self.seq = seq
        self.n = (len(self.tokens) - 1) // seq
        if self.n < 1:
            raise UsageError(
                f"data.dataset {prefix!r} holds {len(self.tokens)} tokens, fewer than "
                f"data.cutoff_len + 1 = {seq + 1}"
            )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Sample:
        w = self.tokens[i * self.seq : i * self.seq + self.seq + 1].astype(np.int64).tolist()
        return Sample(w[:-1], w[1:])


class InstructionSource:
    """Rows of an instruction dataset, cut to ``seq`` inputs; targets from the stored labels
    (prompt tokens -100), shifted once here."""

    def __init__(self, prefix: str, seq: int) -> None:
        from anyspeed.stages.common.instruction_data import check_files, open_data

        check_files(prefix)
        self.data = open_data(prefix, seq)
        self.seq = seq

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Sample:
        ids = np.asarray(self.data.input_ids[i])[: self.seq + 1].astype(np.int64)
        labels = np.asarray(self.data.labels[i])[: len(ids)].astype(np.int64)
        if len(ids) < 2:
            return Sample(ids.tolist(), [IGNORE] * len(ids))
        return Sample(ids[:-1].tolist(), labels[1:].tolist())


def open_source(dataset: str, seq: int, model_dir: str, mm: dict[str, Any]) -> Source:
    """The source the files at ``dataset`` make; UsageError (one line) naming it otherwise."""
    from anyspeed.stages.common.instruction_data import file_prefix

    if dataset.endswith((".json", ".jsonl")):
        if not os.path.isfile(dataset):
            raise UsageError(f"data.dataset {dataset!r} does not exist")
        from anyspeed.fsdp.mm_data import ConversationSource

        return ConversationSource(dataset, seq, model_dir, **mm)
    if os.path.isfile(file_prefix(dataset, "input_ids") + ".bin"):
        return InstructionSource(dataset, seq)
    if os.path.isfile(dataset + ".bin") and os.path.isfile(dataset + ".idx"):
        return PretrainSource(dataset, seq)
    raise UsageError(
        f"data.dataset {dataset!r}: neither {dataset}.bin/.idx (pretraining), "
        f"{file_prefix(dataset, 'input_ids')}.bin (instruction data) nor a .json/.jsonl "
        "conversation file"
    )


def order(n: int, position: int, count: int, seed: int, shuffle: bool) -> list[int]:
    """Sample indices at data positions ``position .. position+count``: epoch after epoch,
    each a fresh seeded permutation (or in order)."""
    out: list[int] = []
    perms: dict[int, np.ndarray] = {}
    for p in range(position, position + count):
        epoch, k = divmod(p, n)
        if not shuffle:
            out.append(k)
            continue
        if epoch not in perms:
            perms[epoch] = np.random.default_rng(seed + epoch).permutation(n)
        out.append(int(perms[epoch][k]))
    return out


def rank_batches(
    source: Source,
    position: int,
    *,
    micro: int,
    accum: int,
    dp: int,
    dp_rank: int,
    multiple: int,
    seed: int,
    shuffle: bool,
) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Each step's micro-batches of data-parallel rank ``dp_rank``, from data ``position``:
    of a global batch of ``micro * dp * accum`` samples, micro-batch j of rank d holds the
    samples at ``(j * dp + d) * micro`` onwards."""
    gbs = micro * dp * accum
    while True:
        idx = order(len(source), position, gbs, seed, shuffle)
        mbs = []
        for j in range(accum):
            at = (j * dp + dp_rank) * micro
            mbs.append(collate([source[i] for i in idx[at : at + micro]], multiple))
        position += gbs
        yield mbs
