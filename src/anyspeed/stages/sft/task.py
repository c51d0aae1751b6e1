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
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anyspeed.errors import UsageError
from anyspeed.models.config import ModelConfig
from anyspeed.models.logprobs import packed_params, token_logprobs
from anyspeed.stages.common.instruction_data import one_prefix
from anyspeed.stages.common.lora_start import lora_start
from anyspeed.stages.common.losses import per_token_loss, token_loss
from anyspeed.training.task import LossFunc, StagePlan, Task

if TYPE_CHECKING:
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run
    from anyspeed.training.step import Trainer


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
    _check_lengths(args, prefix, seen)
    variable = args.variable_seq_lengths or args.no_pad_to_seq_lengths
    cfg = SFTConfig(prefix, data.packed, variable, lora=lora_cfg)
    _check_layout(args, cfg, data, seen)
    records = lora_cfg.record().to_common() if lora_cfg else {}
    return StagePlan([sft_data.file_prefix(prefix, "input_ids")], cfg, data, records)


def _check_lengths(args: argparse.Namespace, prefix: str, seen: Any) -> None:
    """Packed at another --seq-length: refused (rows would be cut and samples mixed). Samples
    longer than --seq-length: counted and reported; nothing left to learn: refused."""
    from anyspeed.launch import reports_here
    from anyspeed.stages.common.instruction_data import split_rows

    s = args.seq_length
    if seen.packed_at is not None and seen.packed_at != s:
        raise UsageError(
            f"--data-path {prefix!r} was packed to sequences of {seen.packed_at} tokens, not "
            f"--seq-length {s}: train with --seq-length {seen.packed_at} or preprocess again "
            f"with --seq-length {s}"
        )
    rows = split_rows(len(seen.learnable), args.split)[0]
    if rows is None or not seen.learnable[rows[0] : rows[1]].any():
        raise UsageError(
            f"--data-path {prefix!r}: no training sample keeps a response token within "
            f"--seq-length {s} (the longest sample has {seen.longest} tokens): nothing to "
            "learn; raise --seq-length or shorten the prompts"
        )
    empty = int((~seen.learnable).sum())
    if (seen.cut or empty) and reports_here():
        print(
            f"anyspeed posttrain: warning: {seen.cut} of {len(seen.learnable)} samples of "
            f"--data-path {prefix!r} are longer than --seq-length {s} and cut to it; "
            f"{empty} keep no response token and add no loss",
            file=sys.stderr,
        )


def _check_layout(args: argparse.Namespace, cfg: SFTConfig, data: Any, seen: Any) -> None:
    from anyspeed.features.base import level_of

    if cfg.variable_lengths and args.pipeline_model_parallel_size > 1:
        raise UsageError(
            "--variable-seq-lengths with --pipeline-model-parallel-size > 1 is not "
            "supported; pad to --seq-length (drop the flag)"
        )
    if not data.packed:
        if args.neat_pack or args.reset_attention_mask:
            raise UsageError(
                f"--data-path {cfg.prefix!r} is not packed (rows are not all "
                f"--seq-length {args.seq_length}); drop --neat-pack/"
                "--reset-attention-mask or preprocess with --pack"
            )
        return
    if (args.neat_pack or args.reset_attention_mask) and seen.one_segment:
        from anyspeed.launch import reports_here

        if reports_here():  # one sample per row, or packed without --neat-pack: alike here
            print(
                f"anyspeed posttrain: note: --data-path {cfg.prefix!r} holds one segment "
                "per row: each row attends as one sample (rows packed without --neat-pack "
                "would let their samples see each other; preprocess with --neat-pack)",
                file=sys.stderr,
            )
    if getattr(args, "experimental_attention_variant", None) and (
        args.neat_pack or args.reset_attention_mask
    ):
        raise UsageError(
            "--neat-pack/--reset-attention-mask with gated DeltaNet layers (Qwen3-Next): the "
            "recurrence does not restart at sample boundaries; preprocess without --pack"
        )
    if args.context_parallel_size > 1:
        raise UsageError(
            "packed SFT data with --context-parallel-size > 1 is not supported; "
            "use unpacked data (padded) or CP 1"
        )
    if level_of(args) < 1:
        raise UsageError(
            "packed SFT data needs the flash-attention feature (per-sample "
            "attention): use --optimization-level 1 or higher"
        )


def make_task(run: Run) -> SFTTask:
    """The SFT task of a checked run."""
    return SFTTask(run.config)


def _unfused_rope(chunk: torch.nn.Module, model: ModelConfig) -> torch.nn.Module:
    # Megatron's fused RoPE seam has no ``thd`` (packed) form on this device; its unfused
    # path restarts the rotary positions at every cu_seqlens boundary.
    chunk.config.apply_rope_fusion = False
    return chunk


class SFTTask(Task):
    """Instruction tuning on padded samples or packed (``thd``) sequences."""

    name = "sft"

    def __init__(self, cfg: SFTConfig) -> None:
        self.cfg = cfg

    def transforms(self) -> list[Any]:
        own = [per_token_loss, _unfused_rope] if self.cfg.packed else [per_token_loss]
        return own + ([self.cfg.lora.transform()] if self.cfg.lora else [])

    def schedule_shape(self, seq_length: int, micro_batch_size: int) -> tuple[int, int]:
        # A packed micro-batch is one sequence of all its rows' tokens.
        if self.cfg.packed:
            return seq_length * micro_batch_size, 1
        return seq_length, micro_batch_size

    def load(self, run: Run, trainer: Trainer, scheduler: Any, state: LoopState) -> bool:
        return lora_start(self.cfg.lora, run, trainer, scheduler, state)

    def forward_step(
        self, data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, LossFunc]:
        batch = next(data_iterator)
        output = token_logprobs(
            model,
            batch["tokens"],
            batch["position_ids"],
            batch["labels"],
            packed_seq_params=packed_params(batch),
        )
        mask = batch["loss_mask"]

        def loss_func(logprobs: torch.Tensor):
            total, count, report = token_loss(-logprobs, mask)
            return total, count, {self.loss_key: report}

        return output, loss_func

    def datasets(self, run: Run) -> list[Any]:
        """(train, valid, test): the instruction data with each split's row range (or None)."""
        from anyspeed.stages.common.instruction_data import split_datasets

        return split_datasets(run.data, run.args.split)

    def batches(
        self,
        dataset: Any,
        run: Run,
        consumed: int,
        device: torch.device,
        trainer: Trainer | None = None,
    ) -> Iterator[list[dict[str, torch.Tensor]]]:
        from anyspeed.stages.common.instruction_data import batches

        data, rows = dataset
        return batches(data, run.args, rows, consumed, device, self.cfg.pad_id)
