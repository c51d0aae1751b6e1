"""Instruction data for SFT: the ``<prefix>_packed_{input_ids,attention_mask,labels}_document``
files ``anyspeed preprocess`` writes (MindSpeed-LLM's layout), read and checked before any
process group, and turned into padded or packed micro-batches.

Labels are stored aligned with the inputs (prompt tokens -100); the shift to next-token targets
happens here, once, so the model never shifts again. A packed row carries its samples' segment
ids in ``attention_mask`` (``--neat-pack``: 1, 2, 3, ... per sample, 0 for padding); a packed
micro-batch becomes one ``thd`` sequence whose ``cu_seqlens`` keep attention and rotary
positions inside each sample.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from anyspeed.errors import UsageError

IGNORE = -100
KINDS = ("input_ids", "attention_mask", "labels")


def file_prefix(prefix: str, kind: str) -> str:
    """The indexed-dataset prefix of one column of an instruction dataset."""
    return f"{prefix}_packed_{kind}_document"


@dataclass
class InstructionData:
    """The rows of one instruction dataset (one sample, or one packed sequence, per row)."""

    input_ids: Any
    labels: Any
    segments: Any  # the attention_mask column: 1/0, or segment ids with --neat-pack
    packed: bool  # every row exactly seq_length long (written with --pack)

    def __len__(self) -> int:
        return len(self.input_ids)


def check_files(prefix: str) -> None:
    """UsageError (one line) unless the three columns of ``prefix`` exist and agree row by row."""
    from anyspeed.data.writer import IndexFileError, check_dataset

    if os.path.isfile(file_prefix(prefix, "input_ids") + ".bin") is False:
        if os.path.isfile(prefix + ".bin"):
            raise UsageError(
                f"--data-path {prefix!r} is a pretraining dataset, not an "
                "instruction dataset (preprocess with an *InstructionHandler)"
            )
        raise UsageError(
            f"--data-path {prefix!r}: {file_prefix(prefix, 'input_ids')}.bin does "
            "not exist (give the --output-prefix that preprocess wrote)"
        )
    lengths = {}
    for kind in KINDS:
        path = file_prefix(prefix, kind)
        if not os.path.isfile(path + ".bin") or not os.path.isfile(path + ".idx"):
            raise UsageError(
                f"--is-instruction-dataset: {path}.bin/.idx does not exist; "
                f"preprocess --data-path {prefix!r} again with an instruction "
                "handler (it writes input_ids, attention_mask and labels)"
            )
        try:
            lengths[kind] = check_dataset(path).lengths
        except (IndexFileError, OSError) as exc:
            raise UsageError(f"--data-path {prefix!r}: {exc}") from None
    for kind in KINDS[1:]:
        if not np.array_equal(lengths[kind], lengths["input_ids"]):
            raise UsageError(
                f"--data-path {prefix!r}: the {kind} rows do not match the "
                "input_ids rows (files of different runs); preprocess again"
            )
    if len(lengths["input_ids"]) == 0:
        raise UsageError(f"--data-path {prefix!r} holds no samples")


def open_data(prefix: str, seq_length: int) -> InstructionData:
    """The three columns of a checked instruction dataset, memory-mapped."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    cols = {k: IndexedDataset(file_prefix(prefix, k)) for k in KINDS}
    lengths = cols["input_ids"].sequence_lengths
    packed = bool(len(lengths)) and bool((lengths == seq_length).all())
    return InstructionData(cols["input_ids"], cols["labels"], cols["attention_mask"], packed)


@dataclass(frozen=True)
class Survey:
    """What training at ``seq_length`` will do to an instruction dataset, known before start:
    the length rows were packed at (None: not packed), how many samples are cut to
    ``seq_length``, and which keep a response token after the cut (a loss to learn from)."""

    packed_at: int | None
    longest: int
    cut: int
    learnable: np.ndarray  # bool per row
    one_segment: bool  # packed rows that each carry one segment id (max id <= 1)


def survey(data: InstructionData, seq_length: int) -> Survey:
    """Scan the rows once (memory-mapped): packing, truncation, rows with nothing to learn."""
    lengths = np.asarray(data.input_ids.sequence_lengths, dtype=np.int64)
    n = len(lengths)
    packed_at, one_segment = None, False
    if n and (lengths == lengths[0]).all():
        first = [np.asarray(data.segments[i]) for i in range(min(n, 64))]
        marked = any((m == 0).any() or (m > 1).any() for m in first)  # padding or sample ids
        if marked or lengths[0] == seq_length:
            packed_at = int(lengths[0])
            one_segment = all(int(m.max()) <= 1 for m in first)
    learnable = np.zeros(n, dtype=bool)
    for i in range(n):
        lab = np.asarray(data.labels[i][1 : min(int(lengths[i]), seq_length)])
        learnable[i] = bool((lab != IGNORE).any())
    cut = 0 if packed_at else int((lengths > seq_length).sum())
    return Survey(packed_at, int(lengths.max()) if n else 0, cut, learnable, one_segment)


def split_rows(n: int, split: str) -> list[tuple[int, int] | None]:
    """Row ranges of (train, valid, test) under Megatron's ``--split`` rule."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    out: list[tuple[int, int] | None] = []
    for bounds in convert_split_vector_to_split_matrix(parse_and_normalize_split(split)):
        if bounds is None:
            out.append(None)
            continue
        lo, hi = int(round(bounds[0] * n)), int(round(bounds[1] * n))
        out.append((lo, hi) if hi > lo else None)
    return out


def sample_order(rows: tuple[int, int], count: int, seed: int) -> np.ndarray:
    """``count`` row indices: seeded permutations of the split's rows, epoch after epoch."""
    lo, hi = rows
    rng = np.random.default_rng(seed)
    epochs = -(-count // (hi - lo))
    return np.concatenate([lo + rng.permutation(hi - lo) for _ in range(epochs)])[:count]


def shifted(ids: np.ndarray, labels: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Next-token targets of one row: ``labels[t+1]`` where t+1 is in t's sample, else -100."""
    out = np.full(len(ids), IGNORE, dtype=np.int64)
    same = seg[1:] == seg[:-1]
    out[:-1] = np.where(same, labels[1:], IGNORE)
    return out


def padded_batch(data: InstructionData, rows: list[int], length: int, pad_id: int) -> dict:
    """Samples padded at the end to ``length`` (cut to it when longer): causal attention needs
    no mask, since no real token sees a later pad."""
    n = len(rows)
    tokens = np.full((n, length), pad_id, dtype=np.int64)
    labels = np.full((n, length), IGNORE, dtype=np.int64)
    for i, r in enumerate(rows):
        ids = np.asarray(data.input_ids[r], dtype=np.int64)[:length]
        lab = np.asarray(data.labels[r], dtype=np.int64)[: len(ids)]
        tokens[i, : len(ids)] = ids
        labels[i, : len(ids)] = shifted(ids, lab, np.zeros(len(ids), np.int64))
    pos = np.broadcast_to(np.arange(length), (n, length))
    return _tensors(tokens, labels, pos)


def packed_batch(data: InstructionData, rows: list[int]) -> dict:
    """Packed rows as one ``thd`` sequence [1, rows x seq]: each run of one segment id (a
    sample under ``--neat-pack``, else a row's samples together) and each row's padding is its
    own attention segment."""
    ids_l, lab_l, pos_l, bounds = [], [], [], [0]
    offset = 0
    for r in rows:
        ids = np.asarray(data.input_ids[r], dtype=np.int64)
        seg = np.asarray(data.segments[r], dtype=np.int64)
        starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
        lens = np.diff(np.r_[starts, len(ids)])
        ids_l.append(ids)
        lab_l.append(shifted(ids, np.asarray(data.labels[r], dtype=np.int64), seg))
        pos_l.append(np.arange(len(ids)) - np.repeat(starts, lens))
        bounds += list(offset + starts[1:]) + [offset + len(ids)]
        offset += len(ids)
    batch = _tensors(
        np.concatenate(ids_l)[None], np.concatenate(lab_l)[None], np.concatenate(pos_l)[None]
    )
    batch["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
    return batch


def _tensors(tokens: np.ndarray, labels: np.ndarray, pos: np.ndarray) -> dict:
    lab = torch.from_numpy(labels)
    mask = lab != IGNORE
    return {
        "tokens": torch.from_numpy(np.ascontiguousarray(tokens)),
        "labels": torch.where(mask, lab, torch.zeros_like(lab)),  # -100 is never an index
        "loss_mask": mask.float(),
        "position_ids": torch.from_numpy(np.ascontiguousarray(pos)).long(),
    }


def pad_length(rows_len: list[int], seq_length: int, multiple: int, variable: bool) -> int:
    """The micro-batch's length: ``seq_length``, or with variable lengths the longest sample
    rounded up to ``multiple`` (never above ``seq_length``)."""
    if not variable:
        return seq_length
    longest = max(rows_len)
    return min(seq_length, -(-longest // multiple) * multiple)


def batches(
    data: InstructionData,
    args: argparse.Namespace,
    rows: tuple[int, int],
    consumed: int,
    device: torch.device,
    pad_id: int = 0,
) -> Iterator[list[dict[str, Any]]]:
    """Per iteration, this rank's micro-batches of the next global batch (samples in Megatron's
    order: global batch i is samples [i*G, (i+1)*G), DP rank k takes every DP-th slice)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs, g = args.micro_batch_size, args.global_batch_size
    from anyspeed.training.datasets import num_samples

    order = sample_order(rows, max(num_samples(args)), args.seed)
    variable = args.variable_seq_lengths or args.no_pad_to_seq_lengths
    multiple = 8 * args.tensor_model_parallel_size * 2 * args.context_parallel_size
    while consumed + g <= len(order):
        micro = []
        for start in range(consumed, consumed + g, mbs * dp):
            idx = [int(i) for i in order[start + rank * mbs : start + (rank + 1) * mbs]]
            if data.packed:
                batch = packed_batch(data, idx)
            else:
                n = pad_length(
                    [len(data.input_ids[i]) for i in idx], args.seq_length, multiple, variable
                )
                batch = padded_batch(data, idx, n, pad_id)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            if "cu_seqlens" not in batch:
                batch = get_batch_on_this_cp_rank(batch)
            micro.append(batch)
        consumed += g
        yield micro
