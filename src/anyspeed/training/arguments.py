"""``anyspeed pretrain`` command line: Megatron-LM / MindSpeed-LLM flag names, checked up front.

Every flag an existing Megatron-LM launch script commonly passes is either implemented or refused
with a one-line error naming it; nothing is silently ignored. ``--model NAME`` fills the
architecture flags from a preset (explicit flags win). :func:`check_args` validates paths,
sizes and layout before any process group starts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from anyspeed.models.presets import apply_preset


class UsageError(ValueError):
    """A bad command line or input file, reported as one line before training starts."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


# Flags Megatron-LM accepts that change nothing on the anyspeed path (kernel fusions are chosen
# by the optimization level; these are harmless to pass through from an existing script).
_ACCEPTED_NOOPS = (
    "--use-mcore-models",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--use-cpu-initialization",
    "--distributed-backend",
    "--transformer-impl",
    "--attention-softmax-in-fp32",
    "--no-create-attention-mask-in-dataloader",
    "--log-timers-to-tensorboard",
    "--log-memory-to-tensorboard",
    "--log-validation-ppl-to-tensorboard",
    "--num-workers",
)
_NOOPS_WITH_VALUE = {"--distributed-backend", "--transformer-impl", "--num-workers"}


def build_parser() -> argparse.ArgumentParser:
    """The pretraining parser (anyspeed feature flags included)."""
    from anyspeed import features

    p = _Parser(prog="anyspeed pretrain", allow_abbrev=False, description=__doc__.split("\n")[0])
    g = p.add_argument_group("launch")
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="start this many local processes with torchrun (omit under torchrun)",
    )
    g.add_argument("--model", default=None, help="architecture preset (see `anyspeed models`)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="gradient bucket size in elements (default: Megatron's)",
    )

    g = p.add_argument_group("architecture")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument(
        "--position-embedding-type",
        choices=("rope", "learned_absolute"),
        default="learned_absolute",
    )
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--padded-vocab-size", type=int, default=None)
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary size without a tokenizer (mock data)",
    )
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)

    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-type",
        default=None,
        choices=("PretrainedFromHF", "HuggingFaceTokenizer", "NullTokenizer"),
    )
    g.add_argument(
        "--tokenizer-name-or-path", "--tokenizer-model", dest="tokenizer_name_or_path", default=None
    )

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
        default="linear",
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
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
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
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--ckpt-format", choices=("torch_dist",), default="torch_dist")
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop (after saving) when the iteration is a multiple of this",
    )

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true")
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

    g = p.add_argument_group("accepted for compatibility (no effect on the anyspeed path)")
    for flag in _ACCEPTED_NOOPS:
        if flag in _NOOPS_WITH_VALUE:
            g.add_argument(flag, default=None, help=argparse.SUPPRESS)
        else:
            g.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    features.add_arguments(p)
    return p


def _unsupported(argv: Sequence[str], parser: argparse.ArgumentParser) -> str | None:
    known = set()
    for action in parser._actions:
        known.update(action.option_strings)
    for tok in argv:
        if tok.startswith("--"):
            flag = tok.split("=", 1)[0]
            if flag not in known:
                return flag
    return None


def parse_pretrain_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a pretraining command line; a preset expands first, unknown flags are errors."""
    try:
        argv = apply_preset(list(argv))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    parser = build_parser()
    bad = _unsupported(argv, parser)
    if bad:
        raise UsageError(
            f"unsupported flag {bad}: anyspeed pretrain does not implement it "
            "(remove it, or see `anyspeed pretrain --help` for the flags it takes)"
        )
    args = parser.parse_args(argv)
    args._argv = list(argv)
    return args


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad the vocabulary to a multiple of divisible_by x TP."""
    m = divisible_by * tp
    return int(math.ceil(vocab / m) * m)


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
    """
    from anyspeed.layout import check_layout

    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "train_iters", "global_batch_size")  # fmt: skip
    if args.lr is None:
        raise UsageError("--lr is required")
    if args.bf16 and args.fp16:
        raise UsageError("--bf16 and --fp16 are exclusive; choose one")
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
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = getattr(args, "context_parallel_size", 1) or 1
    vpp = None
    if args.num_layers_per_virtual_pipeline_stage:
        if pp < 2:
            raise UsageError(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"
            )
        per_stage = args.num_layers // pp
        if per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise UsageError(
                f"--num-layers-per-virtual-pipeline-stage "
                f"{args.num_layers_per_virtual_pipeline_stage} does not divide the "
                f"{per_stage} layers of each pipeline stage"
            )
        vpp = per_stage // args.num_layers_per_virtual_pipeline_stage
    args.virtual_pipeline_model_parallel_size = vpp if vpp and vpp > 1 else None
    from anyspeed.features.context_parallel.feature import ALGO_TO_COMM

    algo = ALGO_TO_COMM.get(getattr(args, "context_parallel_algo", "megatron_cp_algo"), "p2p")
    try:
        check_layout(
            world_size=world_size, tp=tp, pp=pp, vpp=vpp, num_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups, sequence_parallel=args.sequence_parallel,
            cp=cp, cp_algo=algo, seq_length=args.seq_length,
            ulysses_degree=getattr(args, "ulysses_degree_in_cp", None),
        )  # fmt: skip
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise UsageError("--overlap-param-gather needs --use-distributed-optimizer")
    dp = world_size // (tp * pp * cp)
    args.data_parallel_size = dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise UsageError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}"
        )
    if args.train_iters < 0:
        raise UsageError("--train-iters must be >= 0")
    if args.save_interval is not None and args.save_interval <= 0:
        raise UsageError("--save-interval must be positive")
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
    _check_tokenizer_and_vocab(args)
    _check_data(args)


def _check_load(args: argparse.Namespace) -> None:
    """Megatron-LM's rule: a --load directory with no checkpoint yet (scripts pass --load and
    --save the same directory from the first run on) starts from scratch, with a warning."""
    from anyspeed.convert import is_hf_dir
    from anyspeed.training.checkpointing import LATEST, read_latest

    if is_hf_dir(args.load):
        return  # a Hugging Face directory: converted by the caller
    if os.path.exists(args.load) and not os.path.isdir(args.load):
        raise UsageError(f"--load {args.load!r}: not a directory")
    try:
        latest = read_latest(args.load) if os.path.isdir(args.load) else None
    except ValueError as exc:
        raise UsageError(f"--load: {exc}") from None
    if latest is None:
        if args.finetune:
            raise UsageError(f"--finetune needs a checkpoint, but --load {args.load!r} has no "
                             f"{LATEST}")  # fmt: skip
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"anyspeed pretrain: warning: --load {args.load!r} holds no checkpoint yet "
                  f"(no {LATEST}); starting from scratch", file=sys.stderr)  # fmt: skip
        args.load = None


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
    if args.mock_data:
        if args.data_path:
            raise UsageError("--mock-data and --data-path are exclusive")
        return
    if not args.data_path:
        raise UsageError("--data-path PREFIX is required (or --mock-data for synthetic tokens)")
    prefixes, _ = data_blend(args)
    from anyspeed.training.data import max_token_id

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
            top = max_token_id(prefix)
        except Exception as exc:  # Megatron's reader asserts on a bad header
            raise UsageError(
                f"--data-path {prefix!r}: not a Megatron indexed dataset "
                f"({exc or type(exc).__name__})"
            ) from None
        if top >= args.padded_vocab_size:
            raise UsageError(
                f"--data-path {prefix!r} holds token id {top}, at or above the model's "
                f"vocabulary size {args.padded_vocab_size} (wrong tokenizer or "
                "--padded-vocab-size?)"
            )
