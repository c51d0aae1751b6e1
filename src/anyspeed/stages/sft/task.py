"""Supervised fine-tuning (the ``sft`` stage): response tokens only, one global token mean per
global batch; full or LoRA.

The loss function hands Megatron's schedule (token-loss sum, token count); with the config's
``calculateper_token_loss`` Megatron sums gradients over micro-batches and data/context
replicas and divides by the global count, so the loss is the mean over every response token of
the global batch at any TP/PP/CP/DP layout (never a mean of per-sample or per-micro-batch means).
The data: :mod:`anyspeed.stages.common.instruction_data`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.errors import UsageError
from anyspeed.models.logprobs import token_logprobs
from anyspeed.stages.common.instruction_checks import check_layout, check_lengths
from anyspeed.stages.common.instruction_data import one_prefix
from anyspeed.stages.common.instruction_task import InstructionTask
from anyspeed.stages.common.losses import token_loss
from anyspeed.training.packed_rows import model_inputs, to_rows
from anyspeed.training.task import LossFunc, StagePlan

if TYPE_CHECKING:
    from anyspeed.training.run import Run


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The SFT flags (MindSpeed-LLM's names and defaults)."""
    g = p.add_argument_group("fine-tuning")
    g.add_argument(
        "--is-instruction-dataset",
        action="store_true",
        help="--data-path names a preprocessed instruction dataset",
    )
    g.add_argument(
        "--prompt-type",
        default=None,
        help="the chat template the data was preprocessed with (checked)",
    )
    g.add_argument(
        "--variable-seq-lengths",
        action="store_true",
        help="pad each micro-batch to its longest sample, not --seq-length",
    )
    g.add_argument(
        "--no-pad-to-seq-lengths", action="store_true", help="same as --variable-seq-lengths"
    )
    g.add_argument(
        "--pad-to-multiple-of",
        type=int,
        default=None,
        help="with variable lengths, round each micro-batch's length up to a multiple of N "
        "(MindSpeed-LLM's; default 16 x TP x CP: what sequence and context parallelism need)",
    )
    g.add_argument(
        "--no-shuffle",
        action="store_true",
        help="read the samples in file order, epoch after epoch (MindSpeed-LLM's)",
    )
    g.add_argument(
        "--use-remove-padding",
        action="store_true",
        help="each micro-batch's sequences (a pair's chosen and rejected ones too) reach the "
        "model as one packed (thd) sequence: no padding is computed (unpacked data; needs "
        "--optimization-level 1 or higher)",
    )
    g.add_argument(
        "--neat-pack",
        action="store_true",
        help="packed rows carry per-sample segment ids (preprocess --neat-pack)",
    )
    g.add_argument(
        "--padded-samples",
        action="store_true",
        help="accepted: packed rows are already padded to --seq-length",
    )
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="accepted: the SFT loss is always the global token mean",
    )
    g.add_argument(
        "--tokenizer-not-use-fast",
        action="store_true",
        help="accepted: the data is already tokenized",
    )


@dataclass(frozen=True)
class SFTConfig:
    """The checked SFT flags: the dataset prefix, padding and LoRA."""

    prefix: str
    packed: bool
    variable_lengths: bool
    pad_id: int = 0  # pads carry no loss and no real token attends to them
    lora: Any = None  # anyspeed.training.lora.LoRAConfig
    remove_padding: Any = None  # packed at run time (rl.packing.Packing), None: padded rows


def plan(args: argparse.Namespace) -> StagePlan:
    """The SFT checks (before the generic ones); the instruction data, opened once."""
    from anyspeed.stages.common import instruction_data as sft_data
    from anyspeed.training import lora

    if not args.is_instruction_dataset:
        raise UsageError(
            "--stage sft trains on instruction datasets: add "
            "--is-instruction-dataset (and preprocess with an instruction handler)"
        )
    prefix = one_prefix(args, "instruction")
    lora_cfg = lora.from_args(args)
    sft_data.check_files(prefix)
    data = sft_data.open_data(prefix, args.seq_length)
    seen = sft_data.survey(data, args.seq_length)
    check_lengths(args, prefix, seen, "a response token")
    variable = args.variable_seq_lengths or args.no_pad_to_seq_lengths
    remove = _remove_padding(args, data.packed)
    cfg = SFTConfig(prefix, data.packed, variable, lora=lora_cfg, remove_padding=remove)
    check_layout(args, prefix, variable, data, seen)
    records = lora_cfg.record().to_common() if lora_cfg else {}
    return StagePlan([sft_data.file_prefix(prefix, "input_ids")], cfg, data, records)


def _remove_padding(args: argparse.Namespace, packed: bool) -> Any:
    """``--use-remove-padding``'s packing, checked (one line each); None: off."""
    from anyspeed.stages.common.rl.packing import at_cp1

    if args.use_remove_padding and packed:
        raise UsageError(
            "--use-remove-padding packs unpacked samples at run time: this data is packed "
            "already (preprocess --pack); drop the flag"
        )
    return at_cp1(args, "sft")


def make_task(run: Run) -> SFTTask:
    """The SFT task of a checked run."""
    return SFTTask(run.config)


class SFTTask(InstructionTask):
    """Instruction tuning on padded samples or packed (``thd``) sequences."""

    name = "sft"

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        batch = next(data_iterator)
        tokens, pos, labels, packed = model_inputs(batch)  # packed at run time, or the rows
        output = token_logprobs(model, tokens, pos, labels, packed_seq_params=packed)
        mask = batch["loss_mask"]

        def loss_func(logprobs: torch.Tensor):
            total, count, report = token_loss(-to_rows(logprobs, batch), mask)
            return total, count, {self.loss_key: report}

        return output, loss_func
