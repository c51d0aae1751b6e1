"""Checks of a parsed ``anyspeed pretrain`` command line, all before any process group starts.

Each problem is one :class:`UsageError` line naming the flag or file and what would fix it.
The layout is checked by :class:`anyspeed.layout.Layout` (the same check the adaptor runs), the
batch split by :class:`TrainConfig`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from anyspeed.errors import UsageError
from anyspeed.layout import Layout
from anyspeed.models.config import padded_vocab_size
from anyspeed.models.presets import model_from_args
from anyspeed.training.config import TrainConfig


def _require(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) is None:
            raise UsageError(f"--{name.replace('_', '-')} is required (or use --model NAME)")


def data_blend(args: argparse.Namespace) -> tuple[list[str], list[float] | None]:
    """``--data-path`` as (prefixes, weights); weights None when only prefixes are given."""
    items = list(args.data_path or [])
    if len(items) > 1 and _is_number(items[0]):
        if len(items) % 2:
            raise UsageError("--data-path: give WEIGHT PREFIX pairs (an odd number of items)")
        weights = [float(w) for w in items[0::2]]
        if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
            raise UsageError(f"--data-path: the weights {items[0::2]} must be >= 0 and not all "
                             "zero")  # fmt: skip
        return items[1::2], weights
    if any(_is_number(x) for x in items):
        raise UsageError("--data-path: either all PREFIX or WEIGHT PREFIX pairs, not a mix")
    return items, None


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Validate and complete ``args`` in place; UsageError (one line) on any problem.

    Runs before process groups start: sizes, layout, files, tokenizer, vocabulary vs. data.
    Afterwards ``args.model_config``, ``args.layout`` and ``args.train_config`` hold the run's
    model type, layout and training settings.
    """
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "train_iters", "global_batch_size")  # fmt: skip
    if args.lr is None:
        raise UsageError("--lr is required")
    if args.bf16 and args.fp16:
        raise UsageError("--bf16 and --fp16 are exclusive; choose one")
    _complete_architecture(args)
    _check_features(args)
    try:
        layout = Layout.from_args(args)
        layout.validate_for(world_size, args, args.seq_length)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    args.virtual_pipeline_model_parallel_size = layout.vpp
    args.data_parallel_size = layout.dp(world_size)
    train = TrainConfig.from_args(args)
    try:
        train.check(args.data_parallel_size)
        train.recompute.check(args.num_layers // layout.pp, layout.sequence_parallel)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _check_run(args)
    _check_tokenizer_and_vocab(args)
    _check_data(args)
    args.layout, args.train_config = layout, train
    args.model_config = model_from_args(args)
    try:
        args.model_config.check()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _check_load_fits(args)


def _check_features(args: argparse.Namespace) -> None:
    """The features' own checks (flags the device cannot honour), in the launcher too."""
    from anyspeed import features
    from anyspeed.device import detect

    features.validate(args, detect())  # FeatureError is a UsageError: one line


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
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
        if args.swiglu:  # Megatron's default keeps the parameter count of a 4h GELU MLP
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
    if not args.group_query_attention:
        args.num_query_groups = None
    elif args.num_query_groups is None:
        raise UsageError("--group-query-attention needs --num-query-groups")


def _check_run(args: argparse.Namespace) -> None:
    """Checkpoint and output paths (the numbers' ranges: :mod:`anyspeed.training.ranges`)."""
    if args.save_interval and not args.save:
        raise UsageError("--save-interval needs --save DIR")
    if args.save:
        _check_writable(args.save, "--save")
    if args.load:
        _check_load(args)
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


def _check_load(args: argparse.Namespace) -> None:
    """Megatron-LM's rule: a --load directory with no checkpoint yet (scripts pass --load and
    --save the same directory from the first run on) starts from scratch, with a warning. A
    checkpoint is checked file by file (:mod:`anyspeed.training.checkpoint_checks`)."""
    from anyspeed.checkpoint_files import TRACKER, read_tracker
    from anyspeed.convert import is_hf_dir
    from anyspeed.training import checkpoint_checks

    if is_hf_dir(args.load):
        return  # a Hugging Face directory: converted by the caller
    if os.path.exists(args.load) and not os.path.isdir(args.load):
        raise UsageError(f"--load {args.load!r}: not a directory")
    try:
        latest = read_tracker(args.load) if os.path.isdir(args.load) else None
    except ValueError as exc:
        raise UsageError(f"--load: {exc}") from None
    if latest is None:
        if args.finetune:
            raise UsageError(f"--finetune needs a checkpoint, but --load {args.load!r} has no "
                             f"{TRACKER}")  # fmt: skip
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"anyspeed pretrain: warning: --load {args.load!r} holds no checkpoint yet "
                  f"(no {TRACKER}); starting from scratch", file=sys.stderr)  # fmt: skip
        args.load = None
        return
    try:
        checkpoint_checks.check_load(args)
    except checkpoint_checks.CheckpointFileError as exc:
        raise UsageError(f"--load {args.load!r}: {exc}") from None


def _check_load_fits(args: argparse.Namespace) -> None:
    """The --load checkpoint's tensor shapes are those of the model the flags describe."""
    from anyspeed.training import checkpoint_checks

    try:
        checkpoint_checks.check_fits(args)
    except checkpoint_checks.CheckpointFileError as exc:
        raise UsageError(f"--load {args.load!r}: {exc}") from None


def _check_writable(path: str, flag: str) -> None:
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        raise UsageError(f"{flag} {path!r}: directory is not writable")


def _check_tokenizer_and_vocab(args: argparse.Namespace) -> None:
    args.tokenizer = None
    tp = args.tensor_model_parallel_size
    if args.tokenizer_type in ("PretrainedFromHF", "HuggingFaceTokenizer"):
        if not args.tokenizer_name_or_path:
            raise UsageError(f"--tokenizer-type {args.tokenizer_type} needs "
                             "--tokenizer-name-or-path")  # fmt: skip
        from anyspeed.data.errors import UsageError as DataUsageError
        from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer

        try:
            args.tokenizer = load_tokenizer(TokenizerSpec(name_or_path=args.tokenizer_name_or_path))
        except DataUsageError as exc:
            raise UsageError(f"--tokenizer-name-or-path: {exc}") from None
        vocab = args.tokenizer.vocab_size
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


def _check_data(args: argparse.Namespace) -> None:
    """Each --data-path prefix: both files present, the ``.idx`` whole and consistent, the
    ``.bin`` exactly the size it describes, token ids within the vocabulary, every split
    non-empty. Each index is read once, by anyspeed's validating reader."""
    if args.mock_data:
        if args.data_path:
            raise UsageError("--mock-data and --data-path are exclusive")
        return
    if not args.data_path:
        raise UsageError("--data-path PREFIX is required (or --mock-data for synthetic tokens)")
    prefixes, _ = data_blend(args)
    from anyspeed.data.writer import IndexFileError, check_dataset
    from anyspeed.training.datasets import max_token_id

    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                if os.path.isfile(prefix) or prefix.endswith((".bin", ".idx")):
                    raise UsageError(
                        f"--data-path {prefix!r}: give the prefix without .bin/.idx "
                        f"(e.g. {prefix.rsplit('.', 1)[0]!r})"
                    )
                raise UsageError(f"--data-path {prefix!r}: {prefix + ext} does not exist")
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
    forever counting epochs: refuse it, naming the split."""
    from anyspeed.training.datasets import split_tokens

    try:
        tokens = split_tokens(lengths, args.split)
    except (ValueError, AssertionError) as exc:
        raise UsageError(f"--split {args.split!r}: {exc or 'not N,N,N weights'}") from None
    for name, count in zip(("training", "validation", "test"), tokens, strict=True):
        if count == 0:
            raise UsageError(
                f"--split {args.split}: the {name} split of --data-path {prefix!r} gets none of "
                "its documents (too little data for this split); give it a larger share, "
                "more data, or a zero weight"
            )
