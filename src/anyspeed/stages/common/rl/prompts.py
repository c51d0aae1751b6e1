"""Prompt data for reinforcement learning: ``anyspeed preprocess --handler-name
R1AlpacaStyleInstructionHandler`` writes
``<prefix>_packed_{input_ids,attention_mask,labels}_document`` (MindSpeed-RL's layout): each
row's prompt, rendered up to the open answer, and the reference answer's tokens for the
verifier (decoded back to text for the rewards)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from anyspeed.errors import UsageError
from anyspeed.stages.common.instruction_data import IGNORE, file_prefix, split_rows

__all__ = ["PromptData", "check_files", "file_prefix", "open_prompts", "usable_rows"]


@dataclass
class PromptData:
    """Row i: prompt ``input_ids[i]`` and its reference answer's tokens ``labels[i]``."""

    input_ids: Any
    labels: Any

    def __len__(self) -> int:
        return len(self.input_ids)


def check_files(prefix: str) -> None:
    """One UsageError line unless ``prefix`` is a whole prompt dataset (not SFT data)."""
    from anyspeed.data.writer import IndexFileError, check_dataset

    counts = {}
    for kind in ("input_ids", "labels"):
        path = file_prefix(prefix, kind)
        if not (os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx")):
            if os.path.isfile(prefix + ".bin"):
                raise UsageError(
                    f"--data-path {prefix!r} is a pretraining dataset; preprocess "
                    "prompts with --handler-name R1AlpacaStyleInstructionHandler"
                )
            raise UsageError(
                f"--data-path {prefix!r}: {path}.bin/.idx does not exist; "
                "preprocess with --handler-name R1AlpacaStyleInstructionHandler"
            )
        try:
            counts[kind] = len(check_dataset(path).lengths)
        except (IndexFileError, OSError) as exc:
            raise UsageError(f"--data-path {prefix!r}: {exc}") from None
    if counts["input_ids"] != counts["labels"]:
        raise UsageError(
            f"--data-path {prefix!r}: {counts['input_ids']} prompts and "
            f"{counts['labels']} answers (files of different runs)"
        )
    if counts["input_ids"] == 0:
        raise UsageError(f"--data-path {prefix!r} holds no prompts")


def open_prompts(prefix: str) -> PromptData:
    """The prompts and answers, memory-mapped; SFT data (prompt labels -100) is refused."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = PromptData(
        IndexedDataset(file_prefix(prefix, "input_ids")),
        IndexedDataset(file_prefix(prefix, "labels")),
    )
    for i in range(min(len(data), 16)):
        if (np.asarray(data.labels[i]) == IGNORE).any():
            raise UsageError(
                f"--data-path {prefix!r} is SFT data (labels -100 on the prompt): "
                "preprocess prompts with --handler-name "
                "R1AlpacaStyleInstructionHandler"
            )
    return data


def usable_rows(data: PromptData, prefix: str, max_prompt: int, split: str) -> np.ndarray:
    """The training split's rows whose prompt fits ``max_prompt`` tokens (the others are left
    out and counted); none is a UsageError."""
    from anyspeed.launch import reports_here

    rows = split_rows(len(data), split)[0]
    if rows is None:
        raise UsageError(f"--split {split!r} leaves no training prompts")
    lengths = np.asarray(data.input_ids.sequence_lengths[rows[0] : rows[1]])
    keep = rows[0] + np.flatnonzero(lengths <= max_prompt)
    if len(keep) == 0:
        raise UsageError(
            f"--data-path {prefix!r}: no prompt fits --max-prompt-length "
            f"{max_prompt} (the shortest has {int(lengths.min())} tokens)"
        )
    left = len(lengths) - len(keep)
    if left and reports_here():
        print(
            f"anyspeed posttrain: warning: {left} of {len(lengths)} prompts of --data-path "
            f"{prefix!r} are longer than --max-prompt-length {max_prompt} and left out",
            file=sys.stderr,
        )
    return keep
