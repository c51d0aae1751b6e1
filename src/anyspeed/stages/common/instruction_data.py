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
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from anyspeed.errors import UsageError

IGNORE = -100
KINDS = ("input_ids", "attention_mask", "labels")
PAIRWISE = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


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


def check_files(prefix: str, kinds: tuple[str, ...] = KINDS) -> None:
    """UsageError (one line) unless the columns ``kinds`` of ``prefix`` (an instruction
    dataset's, or a pairwise one's: :data:`PAIRWISE`) exist and agree row by row."""
    from anyspeed.data.writer import IndexFileError, check_dataset

    pairwise = kinds == PAIRWISE
    what = "a pairwise" if pairwise else "an instruction"
    handler = "a *PairwiseHandler" if pairwise else "an *InstructionHandler"
    if not os.path.isfile(file_prefix(prefix, kinds[0]) + ".bin"):
        if os.path.isfile(prefix + ".bin"):
            raise UsageError(
                f"--data-path {prefix!r} is a pretraining dataset, not {what} "
                f"dataset (preprocess with {handler})"
            )
        if not pairwise and os.path.isfile(file_prefix(prefix, PAIRWISE[0]) + ".bin"):
            raise UsageError(
                f"--data-path {prefix!r} is a pairwise (preference) dataset: "
                "train it with --stage dpo, simpo or orm --is-pairwise-dataset"
            )
        if pairwise and os.path.isfile(file_prefix(prefix, KINDS[0]) + ".bin"):
            raise UsageError(
                f"--data-path {prefix!r} is an instruction (SFT) dataset, not a "
                "pairwise one: preprocess chosen/rejected records with "
                "AlpacaStylePairwiseHandler or SharegptStylePairwiseHandler"
            )
        raise UsageError(
            f"--data-path {prefix!r}: {file_prefix(prefix, kinds[0])}.bin does "
            "not exist (give the --output-prefix that preprocess wrote)"
        )
    lengths = {}
    for kind in kinds:
        path = file_prefix(prefix, kind)
        if not os.path.isfile(path + ".bin") or not os.path.isfile(path + ".idx"):
            raise UsageError(
                f"--data-path {prefix!r}: {path}.bin/.idx does not exist; preprocess "
                f"again with {handler} (it writes {', '.join(kinds)})"
            )
        try:
            lengths[kind] = check_dataset(path).lengths
        except (IndexFileError, OSError) as exc:
            raise UsageError(f"--data-path {prefix!r}: {exc}") from None
    for kind in kinds[1:]:
        first = kinds[2] if pairwise and kind.startswith("rejected") else kinds[0]
        if kind == "rejected_input_ids" or kind == first:
            continue  # chosen and rejected answers differ in length
        if not np.array_equal(lengths[kind], lengths[first]):
            raise UsageError(
                f"--data-path {prefix!r}: the {kind} rows do not match the "
                f"{first} rows (files of different runs); preprocess again"
            )
    if pairwise and len(lengths[kinds[0]]) != len(lengths[kinds[2]]):
        raise UsageError(
            f"--data-path {prefix!r}: {len(lengths[kinds[0]])} chosen and "
            f"{len(lengths[kinds[2]])} rejected answers; preprocess again"
        )
    if len(lengths[kinds[0]]) == 0:
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


def sample_order(rows: tuple[int, int], count: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """``count`` row indices: seeded permutations of the split's rows, epoch after epoch (in
    file order without ``shuffle``: MindSpeed-LLM's ``--no-shuffle``)."""
    lo, hi = rows
    rng = np.random.default_rng(seed)
    epochs = -(-count // (hi - lo))
    draw = rng.permutation if shuffle else np.arange
    return np.concatenate([lo + draw(hi - lo) for _ in range(epochs)])[:count]


def shifted(ids: np.ndarray, labels: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Next-token targets of one row: ``labels[t+1]`` where t+1 is in t's sample, else -100."""
    out = np.full(len(ids), IGNORE, dtype=np.int64)
    same = seg[1:] == seg[:-1]
    out[:-1] = np.where(same, labels[1:], IGNORE)
    return out


def padded_batch(
    data: InstructionData, rows: list[int], length: int, pad_id: int, aligned: bool = False
) -> dict:
    """Samples padded at the end to ``length`` (cut to it when longer): causal attention needs
    no mask, since no real token sees a later pad. ``aligned``: the labels stay at their
    tokens (a process reward model's step labels), not shifted to next-token targets."""
    n = len(rows)
    tokens = np.full((n, length), pad_id, dtype=np.int64)
    labels = np.full((n, length), IGNORE, dtype=np.int64)
    for i, r in enumerate(rows):
        ids = np.asarray(data.input_ids[r], dtype=np.int64)[:length]
        lab = np.asarray(data.labels[r], dtype=np.int64)[: len(ids)]
        tokens[i, : len(ids)] = ids
        labels[i, : len(ids)] = lab if aligned else shifted(ids, lab, np.zeros(len(ids), np.int64))
    pos = np.tile(np.arange(length), (n, 1))
    return _tensors(tokens, labels, pos)


def packed_batch(data: InstructionData, rows: list[int], aligned: bool = False) -> dict:
    """Packed rows as one ``thd`` sequence [1, rows x seq]: each run of one segment id (a
    sample under ``--neat-pack``, else a row's samples together) and each row's padding is its
    own attention segment. ``aligned``: as :func:`padded_batch`."""
    ids_l, lab_l, pos_l, bounds = [], [], [], [0]
    offset = 0
    for r in rows:
        ids = np.asarray(data.input_ids[r], dtype=np.int64)
        seg = np.asarray(data.segments[r], dtype=np.int64)
        starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
        lens = np.diff(np.r_[starts, len(ids)])
        ids_l.append(ids)
        lab = np.asarray(data.labels[r], dtype=np.int64)
        lab_l.append(lab if aligned else shifted(ids, lab, seg))
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


def pad_multiple(args: argparse.Namespace) -> int:
    """What a variable-length micro-batch's length is rounded up to: a multiple of TP x 2CP
    (sequence and context parallelism split it), 8 of them by default, or of
    ``--pad-to-multiple-of`` N and that."""
    need = args.tensor_model_parallel_size * (
        2 * args.context_parallel_size if args.context_parallel_size > 1 else 1
    )
    asked = getattr(args, "pad_to_multiple_of", None)
    if asked is None:
        return 8 * args.tensor_model_parallel_size * 2 * args.context_parallel_size
    return math.lcm(asked, need)


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
    aligned: bool = False,
    packing: Any = None,
) -> Iterator[list[dict[str, Any]]]:
    """Per iteration, this rank's micro-batches of the next global batch (padded or packed;
    ``aligned``: labels at their own tokens, see :func:`padded_batch`); with ``packing``
    (``--use-remove-padding``) each padded micro-batch also packed for the model."""
    variable = args.variable_seq_lengths or args.no_pad_to_seq_lengths
    multiple = pad_multiple(args)
    sizes: list[list[int]] = []  # the step's micro-batches' real row lengths, in order

    def make(idx: list[int]) -> dict[str, torch.Tensor]:
        if data.packed:
            return packed_batch(data, idx, aligned)
        lens = [len(data.input_ids[i]) for i in idx]
        n = pad_length(lens, args.seq_length, multiple, variable)
        sizes.append([min(k, n) for k in lens])
        return padded_batch(data, idx, n, pad_id, aligned)

    stream = global_batches(args, rows, consumed, device, make, cp_split=packing is None)
    if packing is None:
        yield from stream
        return
    from anyspeed.stages.common.rl.packing import pack_step

    for micro in stream:
        pack_step(micro, sizes[:], packing, args.micro_batch_size * args.seq_length)
        sizes.clear()
        yield micro


def step_rows(
    args: argparse.Namespace, rows: tuple[int, int], consumed: int
) -> Iterator[list[list[int]]]:
    """Per iteration, the sample indices of this rank's micro-batches of the next global batch
    (Megatron's order: global batch i is samples [i*G, (i+1)*G), DP rank k takes every DP-th
    slice of ``--micro-batch-size``)."""
    from megatron.core import parallel_state as ps

    from anyspeed.stages.common.gpt_data import num_samples

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs, g = args.micro_batch_size, args.global_batch_size
    shuffle = not getattr(args, "no_shuffle", False)
    order = sample_order(rows, max(num_samples(args)), args.seed, shuffle)
    while consumed + g <= len(order):
        yield [
            [int(i) for i in order[start + rank * mbs : start + (rank + 1) * mbs]]
            for start in range(consumed, consumed + g, mbs * dp)
        ]
        consumed += g


def global_batches(
    args: argparse.Namespace,
    rows: tuple[int, int],
    consumed: int,
    device: torch.device,
    make: Callable[[list[int]], dict[str, torch.Tensor]],
    cp_split: bool = True,
) -> Iterator[list[dict[str, Any]]]:
    """Per iteration, this rank's micro-batches ``make(row indices)`` of the next global batch
    (:func:`step_rows`), on ``device`` and split for context parallelism unless packed or
    ``cp_split`` is off (the model splits: a vision-language model's pads need the whole row)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    for step in step_rows(args, rows, consumed):
        micro = []
        for idx in step:
            batch = {k: v.to(device, non_blocking=True) for k, v in make(idx).items()}
            if "cu_seqlens" not in batch and cp_split:
                batch = get_batch_on_this_cp_rank(batch)
            micro.append(batch)
        yield micro


def one_prefix(args: argparse.Namespace, what: str) -> str:
    """The one ``--data-path`` prefix of a fine-tuning stage (``--prompt-type`` checked)."""
    if getattr(args, "prompt_type", None) is not None:
        from anyspeed.data.templates import TEMPLATES

        if args.prompt_type not in TEMPLATES:
            raise UsageError(
                f"--prompt-type {args.prompt_type!r} is unknown; choose one of "
                f"{', '.join(sorted(TEMPLATES))}"
            )
    if args.mock_data or not args.data_path or len(args.data_path) != 1:
        raise UsageError(f"--data-path: give exactly one {what} dataset prefix")
    return args.data_path[0]


def split_datasets(data: Any, split: str) -> list[tuple[Any, tuple[int, int]] | None]:
    """(train, valid, test): ``data`` with each ``--split`` part's row range, or None for an
    empty part (what a stage's ``Task.datasets`` returns for row data)."""
    return [None if r is None else (data, r) for r in split_rows(len(data), split)]


def unfused_rope(chunk: torch.nn.Module, model: Any) -> torch.nn.Module:
    """A model transform for packed rows: Megatron's fused RoPE seam has no ``thd`` form on
    this device; its unfused path restarts the rotary positions at every cu_seqlens boundary."""
    chunk.config.apply_rope_fusion = False
    return chunk
