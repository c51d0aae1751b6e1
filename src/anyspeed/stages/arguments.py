"""``anyspeed pretrain`` command line: Megatron-LM / MindSpeed-LLM flag names, parsed once.

Every flag an existing Megatron-LM launch script commonly passes is either implemented, accepted
as a no-op that ``anyspeed features`` lists with its reason, or refused with a one-line error
naming it; nothing is silently ignored. The architecture flags come from the model type's flag
table (:mod:`anyspeed.models.config`), the feature flags from :mod:`anyspeed.features`.
``--model NAME`` fills the architecture flags from a preset (explicit flags win).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence

from anyspeed.argv import get_flag
from anyspeed.distributed.groups import DEFAULT_TIMEOUT_MINUTES
from anyspeed.errors import OneLineArgumentParser, UsageError
from anyspeed.models import config as model_config
from anyspeed.models import recompute
from anyspeed.models.presets import apply_preset
from anyspeed.stages.common import raw_data
from anyspeed.stages.ranges import check_ranges
from anyspeed.training import hf_export, manual_gc, muon

__all__ = ["UsageError", "build_parser", "parse_pretrain_args", "unsupported_flag"]


def _launch_and_parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch")
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="start this many local processes with torchrun (omit under torchrun)",
    )
    g.add_argument("--model", default=None, help="architecture preset (see `anyspeed models`)")
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=DEFAULT_TIMEOUT_MINUTES,
        help="a collective waiting longer than this stops every rank, naming the one that did "
        f"not answer (default {DEFAULT_TIMEOUT_MINUTES:g}; fractions allowed)",
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="layers of the first pipeline stage (uneven stages)",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="layers of the last pipeline stage (uneven stages)",
    )
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="tensor-parallel ranks in an expert (default: the TP size)",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="shard parameters, gradients and optimizer state over the data-parallel ranks with "
        "PyTorch's FSDP2 (Megatron's TorchFullyShardedDataParallel) instead of DDP",
    )
    g.add_argument(
        "--use-megatron-fsdp",
        action="store_true",
        help="Megatron-FSDP over the data-parallel ranks (implies the distributed optimizer)",
    )
    g.add_argument(
        "--data-parallel-sharding-strategy",
        choices=("no_shard", "optim", "optim_grads", "optim_grads_params"),
        default="optim_grads_params",
        help="with --use-megatron-fsdp: what is sharded (optim = ZeRO-1, optim_grads = ZeRO-2, "
        "optim_grads_params = ZeRO-3)",
    )
    g.add_argument(
        "--torch-fsdp2-no-reshard-after-forward",
        action="store_false",
        dest="torch_fsdp2_reshard_after_forward",
        help="keep each layer's gathered parameters from forward to backward (ZeRO-2-like)",
    )
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="gradient bucket size in elements (default: Megatron's)",
    )


def _architecture_and_tokenizer(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("architecture")
    model_config.add_arguments(g)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary size without a tokenizer (mock data)",
    )
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-type",
        default=None,
        choices=("PretrainedFromHF", "HuggingFaceTokenizer", "NullTokenizer"),
    )
    g.add_argument(
        "--tokenizer-name-or-path", "--tokenizer-model", dest="tokenizer_name_or_path", default=None
    )


def _training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style",
        default="linear",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    )
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-style", default="exponential")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer", choices=("adam", "sgd", "muon", "dist_muon"), default="adam")
    muon.add_arguments(g)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="static loss scale for --fp16 (default: dynamic)",
    )
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--seed", type=int, default=1234)


def _data_and_checkpoints(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="PREFIX or WEIGHT PREFIX WEIGHT PREFIX ... (.bin/.idx pairs)",
    )
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="a --load without a checkpoint is an error (else training starts from scratch)",
    )
    g.add_argument(
        "--ckpt-format",
        choices=("torch_dist", "torch"),
        default="torch_dist",
        help="checkpoints are torch_dist (torch: accepted, with a note, from MindSpeed-LLM "
        "recipes)",
    )
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop (after saving) when the iteration is a multiple of this",
    )


def _logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument(
        "--log-throughput",
        action="store_true",
        help="accepted: tokens/s and TFLOP/s are always in the iteration line",
    )
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument(
        "--metrics-file",
        default=None,
        help="append one JSON line per log interval (loss, lr, tokens/s, MFU, ...)",
    )
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--no-progress-bar", action="store_true")
    g.add_argument(
        "--generate-prompt",
        default=None,
        help="after training, print a greedy continuation of this text",
    )
    g.add_argument("--generate-tokens", type=int, default=32)
    g.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler over steps --profile-step-start+1 .. --profile-step-end on "
        "--profile-ranks: a Chrome trace in --tensorboard-dir (else --save) and one line with "
        "the matrix products' share of the step",
    )
    g.add_argument(
        "--use-pytorch-profiler", action="store_true", help="accepted: --profile uses it"
    )
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])


def build_parser() -> argparse.ArgumentParser:
    """The pretraining parser (anyspeed feature flags and accepted no-ops included)."""
    from anyspeed import features

    p = OneLineArgumentParser(
        prog="anyspeed pretrain", allow_abbrev=False, description=__doc__.split("\n")[0]
    )
    for add in (
        _launch_and_parallel,
        _architecture_and_tokenizer,
        _training,
        _data_and_checkpoints,
        raw_data.add_arguments,
        _logging,
        recompute.add_arguments,
        hf_export.add_arguments,
        manual_gc.add_arguments,
    ):
        add(p)
    features.add_arguments(p)
    return p


def unsupported_flag(
    argv: Sequence[str],
    *parsers: argparse.ArgumentParser,
    prog: str = "anyspeed pretrain",
    help_cmd: str | None = None,
) -> str | None:
    """The one-line error for the first ``--flag`` in ``argv`` that none of ``parsers`` defines
    (naming the closest known flag when it looks misspelled); None when every flag is known."""
    known = {
        flag for parser in parsers for action in parser._actions for flag in action.option_strings
    }
    for tok in argv:
        flag = tok.split("=", 1)[0]
        if tok.startswith("--") and flag not in known:
            close = difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.85)
            fix = f"did you mean {close[0]}?" if close else "remove it."
            return (
                f"unsupported flag {flag}: {prog} does not implement it ({fix} "
                f"See `{help_cmd or prog} --help` for the flags it takes)"
            )
    return None


def _pad_preset(argv: list[str], preset: str | None) -> list[str]:
    """With a preset, ``--noop-layers`` and no ``--num-layers``: the preset's layers plus the
    noop slots (``--num-layers`` counts both, MindSpeed's rule)."""
    noop = get_flag(argv, "--noop-layers")
    if preset is None or noop is None or get_flag(argv, "--num-layers") is not None:
        return argv
    from anyspeed.layout.placement import parse_noop_layers
    from anyspeed.models.presets import get_preset

    slots = get_preset(preset).num_layers + len(parse_noop_layers(noop))
    return [*argv, "--num-layers", str(slots)]


def parse_pretrain_args(
    argv: Sequence[str],
    parser: argparse.ArgumentParser | None = None,
    prog: str = "anyspeed pretrain",
) -> argparse.Namespace:
    """Parse a pretraining command line once; a preset expands first, unknown flags are
    errors, and so is a numeric flag out of its range. ``args.model`` keeps the preset's name."""
    try:
        preset = get_flag(argv, "--model")
        argv = _pad_preset(list(argv), preset)
        argv = apply_preset(argv)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    parser = parser or build_parser()
    bad = unsupported_flag(argv, parser, prog=prog, help_cmd=parser.prog)
    if bad:
        raise UsageError(bad)
    args = parser.parse_args(argv)
    check_ranges(args, parser)
    args.model = preset
    return args
