"""A loaded model to run inference on: checkpoint (any saved layout) or HF directory -> chunks.

Shared by ``anyspeed generate`` and ``anyspeed evaluate``: the architecture comes from the
checkpoint's model record (:mod:`anyspeed.checkpoint.record`); an
HF directory is converted once (cached) as ``anyspeed pretrain --load`` does; the weights load
at the layout asked for, whatever layout saved them.
"""

from __future__ import annotations

import argparse

import torch

from anyspeed.errors import UsageError
from anyspeed.layout import Layout
from anyspeed.models.config import ARCH_FLAGS, ModelConfig


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--load``, the tokenizer, the layout and the optional architecture flags to check."""
    g = p.add_argument_group("model")
    g.add_argument("--load", required=True, help="Megatron checkpoint or Hugging Face directory")
    g.add_argument("--tokenizer-name-or-path", default=None,
                   help="HF tokenizer directory (default: --load when it holds one)")  # fmt: skip
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--nproc-per-node", type=int, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--max-length", "--seq-length", dest="max_length", type=int, default=None,
                   help="context window in tokens (default: max positions)")  # fmt: skip
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    for row in ARCH_FLAGS:  # accepted so a mismatch with the checkpoint is a clear error
        if row.arch and row.type is not None:
            g.add_argument(row.flag, dest=f"arch_{row.field}", type=row.type, default=None,
                           help=argparse.SUPPRESS)  # fmt: skip


def model_of(ckpt: str) -> ModelConfig:
    """The architecture the checkpoint under ``ckpt`` records (UsageError naming ``--load``)."""
    from anyspeed.checkpoint.reads import read_common, tracked_dir
    from anyspeed.checkpoint.record import model_in_common

    try:
        path = tracked_dir(ckpt)
        model = model_in_common(read_common(path), ckpt, as_hf=False) if path else None
    except UsageError as exc:  # a broken file or model record
        raise UsageError(f"--load {ckpt!r}: {exc}") from None
    if path is None:
        raise UsageError(f"--load {ckpt!r}: not a checkpoint or Hugging Face directory")
    if model is None:
        raise UsageError(f"--load {ckpt!r}: the checkpoint does not describe its architecture")
    return model


def check_flags(args: argparse.Namespace, model: ModelConfig) -> None:
    """UsageError when an architecture flag given disagrees with the checkpoint."""
    for row in ARCH_FLAGS:
        given = getattr(args, f"arch_{row.field}", None)
        if given is not None and given != getattr(model, row.field):
            raise UsageError(f"{row.flag} {given} does not match the checkpoint "
                             f"({getattr(model, row.field)}); drop the flag or load the "
                             "matching checkpoint")  # fmt: skip


def resolve(args: argparse.Namespace) -> ModelConfig:
    """The architecture ``--load`` holds (an HF directory's from its config.json, padded as
    its conversion will be), checked against the flags; cheap, before any process group."""
    import os

    from anyspeed.convert import hf_cache as hf_load

    if not os.path.isdir(args.load):
        raise UsageError(f"--load {args.load!r}: no such directory")
    args.hf_dir = hf_load.hf_dir_of(["--load", args.load])
    if args.hf_dir:
        if args.tokenizer_name_or_path is None and _has_tokenizer(args.hf_dir):
            args.tokenizer_name_or_path = args.hf_dir
        model = _hf_model(args)
    else:
        model = model_of(args.load)
    check_flags(args, model)
    _check_layout(args, model)
    if args.max_length is None:
        args.max_length = model.max_position_embeddings
    return model


def _hf_model(args: argparse.Namespace) -> ModelConfig:
    import dataclasses

    from anyspeed.convert.hf_io import read_config
    from anyspeed.models.config import padded_vocab_size
    from anyspeed.models.hf import preset_from_hf

    try:
        model = preset_from_hf(read_config(args.hf_dir))
    except ValueError as exc:
        raise UsageError(f"--load {args.hf_dir!r}: {exc}") from None
    vocab = padded_vocab_size(model.vocab_size, args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)  # fmt: skip
    return dataclasses.replace(model, vocab_size=vocab)


def _check_layout(args: argparse.Namespace, model: ModelConfig) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise UsageError("--tensor-model-parallel-size and --pipeline-model-parallel-size "
                         "must be positive")  # fmt: skip
    if model.vocab_size % tp or model.num_attention_heads % tp:
        raise UsageError(f"--tensor-model-parallel-size {tp} does not divide the checkpoint's "
                         f"vocabulary ({model.vocab_size}) and heads "
                         f"({model.num_attention_heads})")  # fmt: skip
    if model.num_layers % pp:
        raise UsageError(f"--pipeline-model-parallel-size {pp} does not divide the "
                         f"{model.num_layers} layers")  # fmt: skip


def materialize(args: argparse.Namespace, argv: list[str],
                prog: str = "anyspeed generate") -> ModelConfig:  # fmt: skip
    """Convert an HF ``--load`` (once, cached) and return the architecture it now holds."""
    from anyspeed.convert import hf_cache as hf_load

    conv = argparse.Namespace(
        padded_vocab_size=None,
        save=None,
        bf16=args.bf16,
        fp16=args.fp16,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )
    args.load = hf_load.convert(conv, args.hf_dir, prog)
    return model_of(args.load)


def _has_tokenizer(d: str) -> bool:
    import os

    return any(os.path.isfile(os.path.join(d, f)) for f in ("tokenizer.json", "tokenizer.model"))


def load_model(ckpt: str, model: ModelConfig, layout: Layout, bf16: bool = False,
               fp16: bool = False) -> list[torch.nn.Module]:  # fmt: skip
    """This rank's chunks with the checkpoint's weights, in eval mode (parallel state set)."""
    from anyspeed.checkpoint.errors import CheckpointMismatch
    from anyspeed.checkpoint.save_load import load_weights
    from anyspeed.device import torch_device
    from anyspeed.models import gpt

    config = gpt.transformer_config(model, layout, bf16=bf16, fp16=fp16)
    chunks = [c.to(torch_device()).eval() for c in gpt.build_chunks(model, config, layout)]
    try:
        load_weights(ckpt, chunks)
    except CheckpointMismatch as exc:
        raise UsageError(str(exc)) from None
    return chunks
