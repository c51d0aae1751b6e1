"""``anyspeed posttrain --stage sft``: supervised fine-tuning (full or LoRA) on the instruction
datasets ``anyspeed preprocess`` writes, with MindSpeed-LLM's ``posttrain_gpt.py`` flags.

It is ``anyspeed pretrain`` with another task: the same parser (plus the fine-tuning flags),
the same checks, launcher, loop, hooks and checkpoints; the SFT task reads the
``<prefix>_packed_*_document`` files and LoRA is a model transform applied before DDP.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from anyspeed.errors import UsageError
from anyspeed.models.lora import TARGETS as LORA_TARGETS
from anyspeed.training import pretrain
from anyspeed.training.arguments import build_parser, parse_pretrain_args
from anyspeed.training.checks import check_args

PROG = "anyspeed posttrain"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The fine-tuning and LoRA flags (MindSpeed-LLM's names and defaults)."""
    g = p.add_argument_group("fine-tuning")
    g.add_argument(
        "--stage",
        choices=("sft",),
        default=None,
        help="what to train: sft (supervised fine-tuning)",
    )
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
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-r", type=int, default=16)
    g.add_argument("--lora-alpha", type=float, default=32)
    g.add_argument("--lora-dropout", type=float, default=0.0)
    g.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=[],
        help=f"layers to adapt, of {' '.join(LORA_TARGETS)}",
    )
    g.add_argument("--lora-load", default=None, help="a LoRA checkpoint to start the adapters from")
    g.add_argument(
        "--lora-modules-to-save",
        nargs="*",
        default=[],
        help="modules trained in full beside the adapters (e.g. output_layer)",
    )


def posttrain_parser() -> argparse.ArgumentParser:
    """The pretraining parser plus the fine-tuning flags."""
    p = build_parser()
    p.prog = PROG
    add_arguments(p)
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    return parse_pretrain_args(argv, posttrain_parser(), prog=PROG)


def check(args: argparse.Namespace, world: int) -> None:
    """Every posttrain problem as one UsageError line, before any process group."""
    from anyspeed.training import sft_data

    if args.stage is None:
        raise UsageError("--stage is required (sft)")
    if not args.is_instruction_dataset:
        raise UsageError(
            "--stage sft trains on instruction datasets: add "
            "--is-instruction-dataset (and preprocess with an instruction handler)"
        )
    if args.prompt_type is not None:
        from anyspeed.data.templates import TEMPLATES

        if args.prompt_type not in TEMPLATES:
            raise UsageError(
                f"--prompt-type {args.prompt_type!r} is unknown; choose one of "
                f"{', '.join(sorted(TEMPLATES))}"
            )
    if args.mock_data or not args.data_path or len(args.data_path) != 1:
        raise UsageError("--data-path: give exactly one instruction dataset prefix")
    _check_lora(args)
    prefix = args.data_path[0]
    sft_data.check_files(prefix)
    args.sft_prefix = prefix
    args.data_path = [sft_data.file_prefix(prefix, "input_ids")]  # vocabulary and split checks
    try:
        check_args(args, world)
    finally:
        args.data_path = [prefix]
    if args.lora_target_modules:  # a LoRA checkpoint names its model, for anyspeed convert
        args.checkpoint_extra["anyspeed_model"] = args.model_config.to_dict()
    args.sft_pad_id = 0  # pads carry no loss and no real token attends to them
    _check_layout(args, sft_data.open_data(prefix, args.seq_length))


def _check_layout(args: argparse.Namespace, data: Any) -> None:
    from anyspeed.features.base import level_of

    variable = args.variable_seq_lengths or args.no_pad_to_seq_lengths
    if variable and args.pipeline_model_parallel_size > 1:
        raise UsageError(
            "--variable-seq-lengths with --pipeline-model-parallel-size > 1 is not "
            "supported; pad to --seq-length (drop the flag)"
        )
    if not data.packed:
        if args.neat_pack or args.reset_attention_mask:
            raise UsageError(
                f"--data-path {args.sft_prefix!r} is not packed (rows are not all "
                f"--seq-length {args.seq_length}); drop --neat-pack/"
                "--reset-attention-mask or preprocess with --pack"
            )
        return
    seg = max(int(data.segments[i].max()) for i in range(min(len(data), 64)))
    if (args.neat_pack or args.reset_attention_mask) and seg <= 1:
        raise UsageError(
            f"--data-path {args.sft_prefix!r} has no per-sample segment ids, so "
            "attention cannot restart per sample; preprocess with --neat-pack"
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


def _check_lora(args: argparse.Namespace) -> None:
    if not args.lora_target_modules:
        if args.lora_load:
            raise UsageError(
                "--lora-load needs --lora-target-modules (and the --lora-r it was trained with)"
            )
        return
    from anyspeed.training import lora

    lora.check_args(args)


def _transforms(args: argparse.Namespace) -> list[Any]:
    if not args.lora_target_modules:
        return []
    from anyspeed.training import lora

    return [lora.transform_from_args(args)]


def train(args: argparse.Namespace, extra_hooks: Sequence[Any] = ()) -> dict[str, Any]:
    """Fine-tune for checked ``args`` in this rank; the history, as ``pretrain.train``'s."""
    from anyspeed.training.sft_data import open_data
    from anyspeed.training.tasks import SFTTask

    task = SFTTask(packed=open_data(args.sft_prefix, args.seq_length).packed)
    load = _lora_load if args.lora_target_modules else None
    return pretrain.train(args, extra_hooks, task=task, transforms=_transforms(args), load=load)


def _lora_load(args: argparse.Namespace, trainer: Any, scheduler: Any, state: Any) -> None:
    """Base weights from ``--load`` (weights only), then adapters, optimizer and position from
    ``--lora-load``; checkpoints written afterwards hold the adapters only."""
    from anyspeed.training import checkpointing as ckpt
    from anyspeed.training.lora import set_view

    if args.load:
        set_view(trainer.model, "base")
        ckpt.load_checkpoint(args.load, trainer.model, None, None, finetune=True, load_rng=False)
    set_view(trainer.model, "adapters")
    if args.lora_load:
        pretrain._load(args, trainer, scheduler, state, root=args.lora_load)


def prepare(argv: list[str], where: str | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Parse and check a posttrain command line (UsageError on any problem)."""
    return pretrain.prepare(argv, where, parse=parse, check=check)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``anyspeed posttrain``."""
    return pretrain.main(argv, "posttrain", prepare, train, posttrain_parser)


if __name__ == "__main__":
    raise SystemExit(main())
