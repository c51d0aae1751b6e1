"""Checks of a parsed training command line, all before any process group starts.

:func:`complete` fills in derived flag values (the namespace is frozen afterwards);
:func:`check` reads the frozen flags and builds the typed parts of the run. Each problem is one
:class:`UsageError` line naming the flag or file and what would fix it. The layout is checked
by :class:`anyspeed.layout.Layout` (the same check the adaptor runs), the batch split by
:class:`TrainConfig`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from anyspeed.convert import hf_cache
from anyspeed.distributed.dualpipev.plan import check_microbatches
from anyspeed.errors import UsageError
from anyspeed.layout import Layout
from anyspeed.models.config import ModelConfig, padded_vocab_size
from anyspeed.models.presets import model_from_args
from anyspeed.training.config import TrainConfig


def _require(args: argparse.Namespace, *names: str) -> None:
    """UsageError for the first of ``names`` left unset; a preset (--model) sets only the
    architecture, so the hint to use one is given only without it."""
    for name in names:
        if getattr(args, name) is None:
            hint = "" if getattr(args, "model", None) else " (or use --model NAME)"
            raise UsageError(f"--{name.replace('_', '-')} is required{hint}")


def complete(args: argparse.Namespace) -> Any:
    """Complete the derived flag values (the one place that writes the parsed namespace,
    before it is frozen) and return the tokenizer (or None); UsageError on a bad request."""
    _require(
        args,
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "train_iters",
        "global_batch_size",
    )
    if args.lr is None:
        raise UsageError("--lr is required")
    if args.bf16 and args.fp16:
        raise UsageError("--bf16 and --fp16 are exclusive; choose one")
    _complete_architecture(args)
    _check_features(args)  # the features' own flag rewrites (MindSpeed names) happen here
    return _complete_vocab(args)


@dataclass(frozen=True)
class Checked:
    """What the generic checks build from the frozen flags."""

    model: ModelConfig
    layout: Layout
    train: TrainConfig
    load: str | None


def check(
    args: argparse.Namespace,
    world_size: int,
    data_prefixes: list[str] | None,
    tokenizer: Any = None,
) -> Checked:
    """Every generic problem as one UsageError line, before process groups start: layout,
    batch split, paths, the ``.bin/.idx`` files ``data_prefixes`` name (None: no files, e.g.
    mock data), and a --load checkpoint that fits. Reads ``args``; writes nothing."""
    try:
        layout = Layout.from_args(args)
        layout.validate_for(world_size, args, args.seq_length)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    train = TrainConfig.from_args(args)
    try:
        train.check(layout.dp(world_size))
        if layout.dualpipev:
            per_step = train.global_batch_size // (train.micro_batch_size * layout.dp(world_size))
            check_microbatches(layout.pp, per_step)
        train.recompute.check(args.num_layers // layout.pp, layout.sequence_parallel)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    load = _check_run(args, layout, world_size)
    for prefix in data_prefixes or ():
        _check_data_files(args, prefix)
    model = model_from_args(args)
    family = hf_cache.family_of_load(args.load)  # the source's, where there is one
    model = model if family in (None, model.family) else model.replace(family=family)
    try:
        model.check()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    rec = train.recompute
    core = rec.granularity == "selective" and "core_attn" in (rec.modules or ["core_attn"])
    if core and model.experimental_attention_variant == "dsa":
        raise UsageError(
            "--recompute-modules core_attn does not run with --experimental-attention-variant "
            "dsa (Megatron's recompute leaves out the indexer's inputs): recompute mlp or "
            "layernorm, or --recompute-granularity full"
        )
    if load:
        _check_load_fits(load, model)
    return Checked(model, layout, train, load)


def gpt_data_prefixes(args: argparse.Namespace) -> list[str] | None:
    """The pretraining stage's data: --data-path's prefixes, or None with --mock-data."""
    from anyspeed.stages.common.gpt_data import data_blend

    if args.mock_data:
        if args.data_path:
            raise UsageError("--mock-data and --data-path are exclusive")
        return None
    if not args.data_path:
        raise UsageError("--data-path PREFIX is required (or --mock-data for synthetic tokens)")
    return data_blend(args)[0]


def _check_features(args: argparse.Namespace) -> None:
    """The features' own checks (flags the device cannot honour), in the launcher too."""
    from anyspeed import features
    from anyspeed.device import detect

    features.validate(args, detect())  # FeatureError is a UsageError: one line


def _check_mrope(args: argparse.Namespace) -> None:
    """mRoPE's 3-D positions come from the images: only the vlm stage makes them."""
    if args.position_embedding_type != "mrope":
        if getattr(args, "mrope_section", None):
            raise UsageError("--mrope-section needs --position-embedding-type mrope")
        return
    if getattr(args, "stage", None) not in ("vlm", "vlm_grpo"):
        raise UsageError(
            "--position-embedding-type mrope: only --stage vlm (Qwen2-VL / Qwen2.5-VL) "
            "makes its 3-D positions; use rope"
        )
    head = args.kv_channels or args.hidden_size // args.num_attention_heads
    section = args.mrope_section or ()
    if 2 * sum(section) != head:
        raise UsageError(
            f"--mrope-section {' '.join(map(str, section)) or '(none)'}: twice its sum must "
            f"be the head dimension {head}"
        )


def _complete_architecture(args: argparse.Namespace) -> None:
    """Megatron-LM's derived defaults: positions, FFN size, query groups."""
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and (
        args.seq_length > args.max_position_embeddings
    ):
        raise UsageError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}"
        )
    _check_mrope(args)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
        if args.swiglu:  # Megatron's default keeps the parameter count of a 4h GELU MLP
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
    if not args.group_query_attention:
        args.num_query_groups = None
    elif args.num_query_groups is None:
        raise UsageError("--group-query-attention needs --num-query-groups")


def _check_run(args: argparse.Namespace, layout: Layout, world: int) -> str | None:
    """Checkpoint and output paths (the numbers' ranges: :mod:`anyspeed.stages.ranges`);
    the checkpoint to start from (None when there is none)."""
    from anyspeed.training import muon

    muon.check(args)
    if args.save_interval and not args.save:
        raise UsageError("--save-interval needs --save DIR")
    if args.save and args.ckpt_format == "torch":
        from anyspeed.launch import reports_here

        if reports_here():  # MindSpeed-LLM's recipes pass it with a Hugging Face --load
            print(
                "anyspeed: note: --ckpt-format torch: checkpoints are saved as torch_dist (any "
                "layout resumes them; `anyspeed convert --ckpt-format legacy` writes "
                "Megatron's per-rank torch format)",
                file=sys.stderr,
            )
    if args.save:
        _check_writable(args.save, "--save")
        from anyspeed.checkpoint.files import lock_holder

        holder = lock_holder(args.save)
        if holder is not None:
            raise UsageError(
                f"--save {args.save!r} is in use by another run (pid {holder}); "
                "wait for it to end or choose another --save"
            )
    load = _check_load(args, layout, world) if args.load else None
    if args.metrics_file:
        _check_writable(os.path.dirname(os.path.abspath(args.metrics_file)), "--metrics-file")
    if args.tensorboard_dir:
        _check_writable(args.tensorboard_dir, "--tensorboard-dir")
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise UsageError(
                "--tensorboard-dir needs the tensorboard package (pip install tensorboard)"
            ) from None
    _check_profile(args, world)
    return load


def _check_profile(args: argparse.Namespace, world: int) -> None:
    """``--profile``'s window and ranks."""
    if not getattr(args, "profile", False):
        return
    if args.profile_step_end <= args.profile_step_start:
        raise UsageError(
            f"--profile-step-end {args.profile_step_end} must be above --profile-step-start "
            f"{args.profile_step_start} (the steps after the start, up to the end, are profiled)"
        )
    iters = getattr(args, "train_iters", None)
    if iters is not None and args.profile_step_start >= iters:
        raise UsageError(
            f"--profile-step-start {args.profile_step_start} is not below --train-iters {iters}: "
            "no step would be profiled (lower it, e.g. --profile-step-start 1 "
            "--profile-step-end 3)"
        )
    bad = [r for r in args.profile_ranks if not 0 <= r < world]
    if bad:
        raise UsageError(f"--profile-ranks {bad[0]}: the ranks of this run are 0..{world - 1}")


def _check_load(args: argparse.Namespace, layout: Layout, world: int) -> str | None:
    """Megatron-LM's rule: a --load directory with no checkpoint yet (scripts pass --load and
    --save the same directory from the first run on) starts from scratch, with a warning. A
    checkpoint is checked file by file (:mod:`anyspeed.checkpoint.checks`)."""
    from anyspeed.checkpoint import checks as checkpoint_checks
    from anyspeed.checkpoint.errors import CheckpointFileError
    from anyspeed.checkpoint.files import TRACKER, read_tracker
    from anyspeed.convert import is_hf_dir

    if is_hf_dir(args.load):
        return args.load  # a Hugging Face directory: converted by the caller
    if os.path.exists(args.load) and not os.path.isdir(args.load):
        raise UsageError(f"--load {args.load!r}: not a directory")
    try:
        latest = read_tracker(args.load) if os.path.isdir(args.load) else None
    except ValueError as exc:
        raise UsageError(f"--load: {exc}") from None
    if latest is None:
        if getattr(args, "exit_on_missing_checkpoint", False):
            raise UsageError(
                f"--load {args.load!r} has no checkpoint ({TRACKER} missing) and "
                "--exit-on-missing-checkpoint is set"
            )
        if args.finetune:
            raise UsageError(
                f"--finetune needs a checkpoint, but --load {args.load!r} has no {TRACKER}"
            )
        from anyspeed.launch import reports_here

        if reports_here():
            print(
                f"anyspeed: warning: --load {args.load!r} holds no checkpoint yet "
                f"(no {TRACKER}); starting from scratch",
                file=sys.stderr,
            )
        return None
    try:
        checkpoint_checks.check_load(
            args.load,
            layout,
            layout.dp(world),
            finetune=args.finetune,
            load_rng=not args.no_load_rng,
        )
    except CheckpointFileError as exc:
        raise UsageError(f"--load {args.load!r}: {exc}") from None
    return args.load


def _check_load_fits(load: str, model: ModelConfig) -> None:
    """The --load checkpoint's tensor shapes are those of the model the flags describe."""
    from anyspeed.checkpoint import checks as checkpoint_checks
    from anyspeed.checkpoint.errors import CheckpointFileError

    try:
        checkpoint_checks.check_fits(load, model)
    except CheckpointFileError as exc:
        raise UsageError(f"--load {load!r}: {exc}") from None


def _check_writable(path: str, flag: str) -> None:
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        raise UsageError(f"{flag} {path!r}: directory is not writable")


def _complete_vocab(args: argparse.Namespace) -> Any:
    """Load the tokenizer (or None) and complete --padded-vocab-size from it."""
    tokenizer = None
    tp = args.tensor_model_parallel_size
    if args.tokenizer_type in ("PretrainedFromHF", "HuggingFaceTokenizer"):
        if not args.tokenizer_name_or_path:
            raise UsageError(
                f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-name-or-path"
            )
        from anyspeed.data.errors import UsageError as DataUsageError
        from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer

        try:
            tokenizer = load_tokenizer(TokenizerSpec(name_or_path=args.tokenizer_name_or_path))
        except DataUsageError as exc:
            raise UsageError(f"--tokenizer-name-or-path: {exc}") from None
        vocab = tokenizer.vocab_size
    elif args.tokenizer_name_or_path:
        raise UsageError("--tokenizer-name-or-path needs --tokenizer-type PretrainedFromHF")
    else:
        vocab = args.vocab_size
    if args.padded_vocab_size is None:
        if vocab is None:
            raise UsageError(
                "no vocabulary size: pass --tokenizer-type PretrainedFromHF "
                "--tokenizer-name-or-path DIR, --vocab-size N or --padded-vocab-size N"
            )
        args.padded_vocab_size = padded_vocab_size(vocab, args.make_vocab_size_divisible_by, tp)
    elif vocab is not None and args.padded_vocab_size < vocab:
        raise UsageError(
            f"--padded-vocab-size {args.padded_vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({vocab})"
        )
    if args.padded_vocab_size % tp:
        raise UsageError(
            f"--padded-vocab-size {args.padded_vocab_size} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    return tokenizer


def _check_data_files(args: argparse.Namespace, prefix: str) -> None:
    """One data prefix: both files present, the ``.idx`` whole and consistent, the ``.bin``
    exactly the size it describes, token ids within the vocabulary, every split non-empty.
    The index is read once, by anyspeed's validating reader."""
    from anyspeed.data.writer import IndexFileError, check_dataset
    from anyspeed.stages.common.gpt_data import max_token_id

    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            if os.path.isfile(prefix) or prefix.endswith((".bin", ".idx")):
                raise UsageError(
                    f"--data-path {prefix!r}: give the prefix without .bin/.idx "
                    f"(e.g. {prefix.rsplit('.', 1)[0]!r})"
                )
            near = f"{prefix}_text_document"  # what preprocess wrote for output prefix PREFIX
            hint = f" (give {near!r})" if os.path.isfile(near + ext) else ""
            raise UsageError(f"--data-path {prefix!r}: {prefix + ext} does not exist{hint}")
    try:
        index = check_dataset(prefix)
    except (IndexFileError, OSError) as exc:
        raise UsageError(f"--data-path {prefix!r}: {exc}") from None
    top = max_token_id(prefix + ".bin", index.dtype)
    if top >= args.padded_vocab_size:
        raise UsageError(
            f"--data-path {prefix!r} holds token id {top}, at or above the model's "
            f"vocabulary size {args.padded_vocab_size} (wrong tokenizer or "
            "--padded-vocab-size?)"
        )
    _check_split(args, prefix, index.lengths)


def _check_split(args: argparse.Namespace, prefix: str, lengths: np.ndarray) -> None:
    """A split with a share of the data but no documents makes Megatron's GPTDataset loop
    forever counting epochs: refuse it, naming the split (validation and test only when
    ``--eval-iters`` reads them)."""
    from anyspeed.stages.common.gpt_data import split_tokens

    try:
        tokens = split_tokens(lengths, args.split)
    except (ValueError, AssertionError) as exc:
        raise UsageError(f"--split {args.split!r}: {exc or 'not N,N,N weights'}") from None
    names = ("training", "validation", "test") if args.eval_iters else ("training",)
    for name, count in zip(names, tokens, strict=False):
        if count == 0:
            raise UsageError(
                f"--split {args.split}: the {name} split of --data-path {prefix!r} gets none of "
                "its documents (too little data for this split); give it a larger share, "
                "more data, or a zero weight"
            )
