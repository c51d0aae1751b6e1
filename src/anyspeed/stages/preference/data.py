"""Pairwise (preference) data for DPO, SimPO and the reward model: the
``<prefix>_packed_{chosen,rejected}_{input_ids,labels}_document`` files ``anyspeed preprocess``
writes with a ``*PairwiseHandler`` (MindSpeed-LLM's layout), checked before any process group
and turned into micro-batches of pairs.

A micro-batch of ``m`` pairs is one [2m, L] batch: rows 0..m-1 the chosen answers, rows
m..2m-1 the rejected ones, each padded at the end to L (``--seq-length``, or with
``--variable-seq-lengths`` the pair batch's longest, rounded up). Labels are shifted once, here,
as for SFT (:mod:`anyspeed.stages.common.instruction_data`); prompt tokens carry no label.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from anyspeed.errors import UsageError
from anyspeed.stages.common.instruction_data import (
    IGNORE,
    PAIRWISE,
    InstructionData,
    check_files,
    file_prefix,
    pad_length,
    pad_multiple,
    padded_batch,
    split_rows,
    step_rows,
)


@dataclass
class PairwiseData:
    """The chosen and rejected answers of one pairwise dataset (row i: pair i)."""

    chosen: InstructionData
    rejected: InstructionData

    def __len__(self) -> int:
        return len(self.chosen)


def open_pairs(prefix: str) -> PairwiseData:
    """The four columns of a pairwise dataset (checked: :func:`check_pairs`), memory-mapped."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    cols = {k: IndexedDataset(file_prefix(prefix, k)) for k in PAIRWISE}

    def side(name: str) -> InstructionData:
        return InstructionData(cols[f"{name}_input_ids"], cols[f"{name}_labels"], None, False)

    return PairwiseData(side("chosen"), side("rejected"))


def check_pairs(prefix: str) -> None:
    """One UsageError line unless ``prefix`` is a whole pairwise dataset."""
    check_files(prefix, PAIRWISE)


def _learnable(side: InstructionData, seq_length: int) -> tuple[np.ndarray, int]:
    lengths = np.asarray(side.input_ids.sequence_lengths, dtype=np.int64)
    keep = np.zeros(len(lengths), dtype=bool)
    for i in range(len(lengths)):
        lab = np.asarray(side.labels[i][1 : min(int(lengths[i]), seq_length)])
        keep[i] = bool((lab != IGNORE).any())
    return keep, int((lengths > seq_length).sum())


def check_lengths(data: PairwiseData, prefix: str, seq_length: int, split: str) -> None:
    """Pairs whose answers are cut to ``seq_length`` are counted and reported; a pair one of
    whose answers keeps no token is compared on nothing (reported); no learnable training
    pair at all is refused."""
    from anyspeed.launch import reports_here

    kc, cut_c = _learnable(data.chosen, seq_length)
    kr, cut_r = _learnable(data.rejected, seq_length)
    both = kc & kr
    same = _identical(data, seq_length)
    rows = split_rows(len(both), split)[0]
    train = slice(*rows) if rows is not None else slice(0, 0)
    if not both[train].any():
        raise UsageError(
            f"--data-path {prefix!r}: no training pair keeps a chosen and a rejected answer "
            f"token within --seq-length {seq_length}: raise --seq-length or shorten the prompts"
        )
    if not (both & ~same)[train].any():
        raise UsageError(
            f"--data-path {prefix!r}: every training pair's chosen and rejected answers are the "
            f"same tokens within --seq-length {seq_length}: nothing to prefer (check --map-keys)"
        )
    empty, alike = int((~both).sum()), int((both & same).sum())
    if (cut_c or cut_r or empty or 2 * alike > len(both)) and reports_here():
        print(
            f"anyspeed posttrain: warning: {cut_c} chosen and {cut_r} rejected answers of "
            f"--data-path {prefix!r} are longer than --seq-length {seq_length} and cut to "
            f"it; {empty} pairs keep no answer token on one side; {alike} of {len(both)} "
            "pairs have the same tokens on both sides (they teach nothing)",
            file=sys.stderr,
        )


def _identical(data: PairwiseData, seq_length: int) -> np.ndarray:
    """Per pair: whether its chosen and rejected rows are the same tokens and labels within
    ``seq_length`` (the loss sees nothing that tells them apart)."""
    out = np.zeros(len(data), dtype=bool)
    for i in range(len(out)):
        c, r = data.chosen, data.rejected
        out[i] = np.array_equal(c.input_ids[i][:seq_length], r.input_ids[i][:seq_length]) and (
            np.array_equal(c.labels[i][:seq_length], r.labels[i][:seq_length])
        )
    return out


def pair_batch(data: PairwiseData, rows: list[int], length: int, pad_id: int) -> dict:
    """``rows``' pairs as one [2m, length] batch: chosen rows first, then rejected."""
    c = padded_batch(data.chosen, rows, length, pad_id)
    r = padded_batch(data.rejected, rows, length, pad_id)
    return {k: torch.cat([c[k], r[k]]) for k in c}


def packing_of(args: argparse.Namespace, kind: str) -> Any:
    """The remove-padding of a pairwise run (``--use-remove-padding``), checked: one line for
    what it cannot work with; None: padded rows."""
    from anyspeed.stages.common.rl import packing

    pair = 2 * args.seq_length  # a budget holds whole pairs; default: a padded micro-batch's
    return packing.at_cp1(args, kind, least=pair, default=pair * args.micro_batch_size)


def batches(
    data: PairwiseData,
    args: argparse.Namespace,
    rows: tuple[int, int],
    consumed: int,
    device: torch.device,
    cfg: Any,
) -> Iterator[list[dict[str, Any]]]:
    """Per iteration, this rank's micro-batches of pairs of the next global batch
    (``--micro-batch-size`` and ``--global-batch-size`` count pairs); under remove-padding
    each also packed for the model (``cfg.packing``), and with a dynamic batch size the step's
    pairs split into micro-batches by its token budget instead of by count."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from anyspeed.stages.common.rl import packing as P

    variable = args.variable_seq_lengths or args.no_pad_to_seq_lengths
    multiple = pad_multiple(args)
    packed = cfg.packing
    for step in step_rows(args, rows, consumed):
        if packed is not None and packed.budget:
            step = _by_budget(data, step, args, packed)
        micro, sizes = [], []
        for idx in step:
            lens = [len(s.input_ids[i]) for s in (data.chosen, data.rejected) for i in idx]
            length = pad_length(lens, args.seq_length, multiple, variable)
            sizes.append([min(n, length) for n in lens])
            made = pair_batch(data, idx, length, cfg.pad_id)
            b = {k: v.to(device, non_blocking=True) for k, v in made.items()}
            micro.append(b if packed is not None else get_batch_on_this_cp_rank(b))
        if packed is not None:
            limit = packed.budget or 2 * args.micro_batch_size * args.seq_length
            P.pack_step(micro, sizes, packed, limit)
        yield micro


def _by_budget(data: PairwiseData, step: list[list[int]], args: Any, packed: Any) -> list:
    """The step's pairs split into micro-batches of at most the budget's tokens (balanced,
    longest first; as many on every rank where replicas exchange tokens)."""
    from anyspeed.stages.common.rl import packing as P

    flat = [i for idx in step for i in idx]
    cut = args.seq_length
    tokens = [
        min(len(data.chosen.input_ids[i]), cut) + min(len(data.rejected.input_ids[i]), cut)
        for i in flat
    ]
    parts = P.groups(tokens, len(flat), args.micro_batch_size, packed)
    return [[flat[j] for j in part] for part in parts]
