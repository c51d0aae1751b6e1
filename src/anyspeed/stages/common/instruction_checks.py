"""The checks every stage on instruction-layout data shares (SFT, the process reward model):
lengths against --seq-length, and padding or packing against the layout."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from anyspeed.errors import UsageError


def check_lengths(args: argparse.Namespace, prefix: str, seen: Any, what: str) -> None:
    """Packed at another --seq-length: refused (rows would be cut and samples mixed). Samples
    longer than --seq-length: counted and reported; nothing left to learn (no sample keeps
    ``what``, a labelled token): refused."""
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
            f"--data-path {prefix!r}: no training sample keeps {what} within "
            f"--seq-length {s} (the longest sample has {seen.longest} tokens): nothing to "
            "learn; raise --seq-length or shorten the prompts"
        )
    empty = int((~seen.learnable).sum())
    if (seen.cut or empty) and reports_here():
        print(
            f"anyspeed posttrain: warning: {seen.cut} of {len(seen.learnable)} samples of "
            f"--data-path {prefix!r} are longer than --seq-length {s} and cut to it; "
            f"{empty} keep no {what.split(' ', 1)[1]} and add no loss",
            file=sys.stderr,
        )


def check_layout(
    args: argparse.Namespace, prefix: str, variable: bool, data: Any, seen: Any
) -> None:
    """Padding, packing and the layout agree: variable lengths need PP 1; packed rows need
    per-sample attention (level 1), CP 1 and no recurrence across samples."""
    from anyspeed.features.base import level_of

    if variable and args.pipeline_model_parallel_size > 1:
        raise UsageError(
            "--variable-seq-lengths with --pipeline-model-parallel-size > 1 is not "
            "supported; pad to --seq-length (drop the flag)"
        )
    if not data.packed:
        if args.neat_pack or args.reset_attention_mask:
            raise UsageError(
                f"--data-path {prefix!r} is not packed (rows are not all "
                f"--seq-length {args.seq_length}); drop --neat-pack/"
                "--reset-attention-mask or preprocess with --pack"
            )
        return
    if (args.neat_pack or args.reset_attention_mask) and seen.one_segment:
        from anyspeed.launch import reports_here

        if reports_here():  # one sample per row, or packed without --neat-pack: alike here
            print(
                f"anyspeed posttrain: note: --data-path {prefix!r} holds one segment "
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
            "packed instruction data with --context-parallel-size > 1 is not supported; "
            "use unpacked data (padded) or CP 1"
        )
    if level_of(args) < 1:
        raise UsageError(
            "packed instruction data needs the flash-attention feature (per-sample "
            "attention): use --optimization-level 1 or higher"
        )
