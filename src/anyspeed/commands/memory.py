"""``anyspeed memory``: does a training layout fit? Per-rank memory before anything starts.

Takes ``anyspeed pretrain``'s flags (``--model`` preset, layout, precision, micro-batch,
sequence, recompute and memory features) plus ``--world-size N`` (default: one data-parallel
replica) and prints the parameters, gradients, optimizer state and activations of the rank
that needs the most. ``--fits GiB`` instead lists every layout of ``--world-size`` devices
(TP x PP x DP, distributed optimizer, recompute) whose largest rank fits in that budget.
``--critic`` adds PPO's critic (``posttrain --stage ppo``): a second model of the architecture
with its gradients and optimizer state on every rank, named when it is what does not fit.
``--teacher-model DIR`` adds a distillation teacher (``posttrain --stage distill``) and
``--process-reward-model DIR`` a process reward model (``posttrain --stage grpo/ppo``): each a
checkpoint or a Hugging Face directory, its architecture read from it; its parameters, frozen
at the same layout.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence

from anyspeed.argv import pop_flag
from anyspeed.device import detect
from anyspeed.distributed.dualpipev.plan import check_microbatches
from anyspeed.errors import UsageError, report
from anyspeed.features.compat.noop_layers import rewrite_noop_layers
from anyspeed.layout import Layout
from anyspeed.models.config import ModelConfig, padded_vocab_size
from anyspeed.models.memory import (
    Options,
    RankMemory,
    critic_bytes,
    estimate,
    estimate_stage,
    frozen_bytes,
    zero_stage,
)
from anyspeed.models.presets import model_from_args
from anyspeed.models.recompute import Recompute

PROG = "anyspeed memory"
GIB = 2**30
RECOMPUTE_CHOICES = {
    "none": Recompute(),
    "selective": Recompute(granularity="selective", modules=["core_attn", "mlp"]),
    "act+norm": Recompute(),  # anyspeed's activation-function and norm recompute
    "full": Recompute(granularity="full", method="uniform", num_layers=1),
}
# the frozen models beside the trained one, by flag: their line in the report
FROZEN = {
    "--teacher-model": "teacher (--teacher-model, distillation): frozen parameters",
    "--process-reward-model": "PRM (--process-reward-model): frozen parameters",
}


def _number(flag: str, value: str | None, kind: type) -> float | None:
    if value is None:
        return None
    try:
        number = kind(value)
    except ValueError:
        number = 0
    if not 0 < number < float("inf"):  # nan fails both
        raise UsageError(f"{flag} must be a positive, finite number (got {value!r})")
    return number


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, int | None, float | None]:
    """(pretraining flags, --world-size, --fits GiB); UsageError (one line) on bad input.
    ``args.critic``: whether ``--critic`` was given."""
    from anyspeed.stages.arguments import parse_pretrain_args

    critic = "--critic" in argv
    argv = [a for a in argv if a != "--critic"]
    try:
        world, argv = pop_flag(list(argv), "--world-size")
        fits, argv = pop_flag(argv, "--fits")
        paths = {}
        for flag in FROZEN:
            paths[flag], argv = pop_flag(argv, flag)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    args = parse_pretrain_args(argv)
    try:
        rewrite_noop_layers(args)  # --num-layers counts the noop slots: the real layers
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, name) is None:
            raise UsageError(f"--{name.replace('_', '-')} is required (or use --model NAME)")
    if args.padded_vocab_size is None:
        if args.vocab_size is None:
            raise UsageError(
                "no vocabulary size: pass --model NAME, --vocab-size N or --padded-vocab-size N"
            )
        args.padded_vocab_size = padded_vocab_size(
            args.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        )
    args.critic = critic
    args.frozen = {f: _frozen_model(f, p) for f, p in paths.items() if p is not None}
    return args, _number("--world-size", world, int), _number("--fits", fits, float)


def options(args: argparse.Namespace, dp: int, recompute: str | None = None) -> Options:
    """The estimate's settings from the flags (``recompute``: one of RECOMPUTE_CHOICES)."""
    gbs = args.global_batch_size or args.micro_batch_size * dp
    act = args.recompute_activation_function_num_layers if args.recompute_activation_function else 0
    norm = args.recompute_norm_num_layers if args.recompute_norm else 0
    rec = Recompute.from_args(args)
    if recompute is not None:
        rec = RECOMPUTE_CHOICES[recompute]
        act = norm = None if recompute == "act+norm" else 0
    return Options(
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=max(gbs // (args.micro_batch_size * dp), 1),
        precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        optimizer=args.optimizer,
        recompute=rec,
        recompute_activation=act,
        recompute_norm=norm,
        math_attention=not detect().is_cuda,  # MLA's attention: fused on CUDA only
        fp8=bool(getattr(args, "fp8", None)),
    )


def _gib(n: float) -> str:
    return f"{n / GIB:8.3f}"


def describe(mem: RankMemory) -> str:
    """The per-rank table of one estimate."""
    grads = "gradients" + (
        f" ({mem.main_gradients / GIB:.3f} GiB fp32 copies: not with activations)"
        if mem.main_gradients
        else ""
    )
    rows = [
        ("parameters", mem.parameters),
        (grads, mem.gradients),
        ("optimizer state", mem.optimizer),
        (
            f"activations ({mem.microbatches_in_flight:g} micro-batch(es) in flight; "
            f"{mem.activations_per_microbatch / 2**20:.1f} MiB each)",
            mem.activations,
        ),
        ("peak (total)", mem.total),
    ]
    return "\n".join(f"  {name:<62} {_gib(value)} GiB" for name, value in rows)


def _layouts(args: argparse.Namespace, model: ModelConfig, world: int):
    """Every (layout, recompute choice) of ``world`` devices that Megatron would accept (MoE:
    every expert-parallel size too)."""
    eps = [e for e in range(1, world + 1) if model.num_experts and model.num_experts % e == 0]
    for tp, pp, ep in itertools.product(range(1, world + 1), range(1, world + 1), eps or [1]):
        if world % (tp * pp) or tp > 8:
            continue
        for distopt, rec in itertools.product((False, True), RECOMPUTE_CHOICES):
            lay = Layout(
                tp=tp,
                pp=pp,
                sequence_parallel=tp > 1,
                distributed_optimizer=distopt,
                ep=ep,
                noop_layers=args.noop_layers or (),
            )
            if distopt and lay.dp(world) == 1:
                continue
            try:
                lay.validate_for(world, model, args.seq_length)
                for frozen in args.frozen.values():  # at the same layout: it must split too
                    lay.validate_for(world, frozen, args.seq_length)
            except ValueError:
                continue
            if model.vocab_size % tp:
                continue
            yield lay, rec


def _frozen_model(flag: str, path: str) -> ModelConfig:
    """The architecture of a frozen model's directory (``flag``): a checkpoint's model
    record, or a Hugging Face directory's config.json (a vision-language checkpoint's text
    model)."""
    from anyspeed.checkpoint.errors import ModelRecordError
    from anyspeed.checkpoint.reads import tracked_dir
    from anyspeed.checkpoint.record import read_model
    from anyspeed.convert import is_hf_dir
    from anyspeed.convert.api import preset_of
    from anyspeed.convert.hf_io import read_config

    try:
        if tracked_dir(path):
            return read_model(tracked_dir(path))
        if is_hf_dir(path):
            return preset_of(read_config(path), None)
    except (ModelRecordError, UsageError) as exc:
        raise UsageError(f"{flag} {path!r}: {exc}") from None
    raise UsageError(
        f"{flag} {path!r} is neither a checkpoint (no tracker file) nor a Hugging "
        "Face model directory (no config.json)"
    )


def _with_extras(
    args: argparse.Namespace, model: ModelConfig, lay: Layout, world: int, o: Options
) -> tuple[int, int, dict[str, int]]:
    """(the largest rank's total, the critic's share of it, each frozen model's by its flag):
    0 and {} without ``--critic`` and frozen models."""
    stages = []
    for mem in (estimate_stage(model, lay, world, o, s) for s in range(lay.pp)):
        c = critic_bytes(model, lay, world, o, mem.stage) if args.critic else 0
        held = {f: frozen_bytes(m, lay, mem.stage, o.dtype_bytes) for f, m in args.frozen.items()}
        stages.append((mem.total + c + sum(held.values()), c, held))
    return max(stages, key=lambda x: x[0])


def fits(args: argparse.Namespace, model: ModelConfig, world: int, budget: float) -> str:
    """The layouts of ``world`` devices whose largest rank needs at most ``budget`` GiB (with
    the critic under ``--critic``; when it is the critic that does not fit, it is named)."""
    rows, without = [], 0
    for lay, rec in _layouts(args, model, world):
        o = options(args, lay.dp(world), rec)
        total, critic, _ = _with_extras(args, model, lay, world, o)
        if total <= budget * GIB:
            rows.append((total, lay, rec))
        elif total - critic <= budget * GIB:
            without += 1
    if not rows and without:
        return (
            f"no layout of {world} devices fits in {budget:g} GiB per rank with PPO's critic "
            f"(--critic: a second model with its gradients and optimizer state); without it, "
            f"{without} would"
        )
    if not rows:
        return f"no layout of {world} devices fits in {budget:g} GiB per rank"
    out = [
        f"layouts of {world} devices that fit in {budget:g} GiB per rank (smallest first):",
        f"  {'TP':>3} {'PP':>3} {'DP':>3} {'EP':>3} {'distopt':<8} {'recompute':<10} "
        f"{'GiB/rank':>9}",
    ]
    for total, lay, rec in sorted(rows, key=lambda r: r[0]):
        distopt = "yes" if lay.distributed_optimizer else "no"
        out.append(
            f"  {lay.tp:>3} {lay.pp:>3} {lay.dp(world):>3} {lay.ep:>3} {distopt:<8} "
            f"{rec:<10} {_gib(total)}"
        )
    return "\n".join(out)


def run(argv: Sequence[str]) -> str:
    """The report ``anyspeed memory`` prints for ``argv``; UsageError on bad input."""
    args, world, budget = parse(argv)
    model = model_from_args(args)
    try:
        lay = Layout.from_args(args)
        world = world or lay.tp * lay.pp * lay.cp
        lay.validate_for(world, model, args.seq_length)
        Recompute.from_args(args).check(model.num_layers // lay.pp, lay.sequence_parallel)
        if lay.dualpipev:
            check_microbatches(lay.pp, options(args, lay.dp(world)).num_microbatches)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for flag, frozen in args.frozen.items():
        try:
            lay.validate_for(world, frozen, args.seq_length)
        except ValueError as exc:
            raise UsageError(f"{flag} at this layout: {exc}") from None
    if budget is not None:
        return fits(args, model, world, budget)
    o = options(args, lay.dp(world))
    mem = estimate(model, lay, world, o)
    table = describe(mem)
    if args.critic or args.frozen:
        total, critic, held = _with_extras(args, model, lay, world, o)
        if args.critic:
            name = "critic (--critic, PPO): parameters, gradients, optimizer state"
            table += f"\n  {name:<62} {_gib(critic)} GiB"
        for flag, n in held.items():
            table += f"\n  {FROZEN[flag]:<62} {_gib(n)} GiB"
        table += f"\n  {'peak with them (the largest rank)':<62} {_gib(total)} GiB"
    return (
        f"{model.name} ({model.num_parameters() / 1e6:,.1f}M params), {world} devices: "
        f"TP={lay.tp} PP={lay.pp} {lay.schedule} CP={lay.cp} DP={lay.dp(world)} "
        f"SP={lay.sequence_parallel} distopt={lay.distributed_optimizer}{_fsdp(lay)}, seq "
        f"{args.seq_length}, micro-batch {args.micro_batch_size}; the largest rank "
        f"(pipeline stage {mem.stage}):\n" + table
    )


def _fsdp(lay: Layout) -> str:
    if lay.torch_fsdp2:
        return " FSDP2 (ZeRO-3)"
    if lay.megatron_fsdp:
        return f" Megatron-FSDP {lay.fsdp_sharding} (ZeRO-{zero_stage(lay)})"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``anyspeed memory``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip())
        return 0
    try:
        print(run(argv))
    except UsageError as exc:
        return report(PROG, exc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
