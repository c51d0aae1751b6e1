"""``anyspeed verify [OPTIONS] {pretrain|posttrain} FLAGS...``: does this layout train the way
one process does?

Both command lines are checked before anything starts. The reference (one process, or the
layout ``--reference`` gives) runs first: it writes its initial weights with Megatron's
dist_checkpointing and, at each step, its gradients after the data-parallel reduction. The
layout under test then starts from those weights (read resharded), trains on the same global
batches and compares every gradient tensor with the reference's, read resharded into its own
layout. The report gives, per step, loss and grad norm of both and the worst gradient, and on
divergence the first differing tensor in model order; the exit code is 1 above tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from anyspeed.errors import UsageError, report

PROG = "anyspeed verify"
COMMANDS = ("pretrain", "posttrain")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [OPTIONS] {{pretrain,posttrain}} TRAINING FLAGS...",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    p.add_argument("--steps", type=int, default=3, help="optimizer steps compared (default 3)")
    p.add_argument(
        "--rtol",
        type=float,
        default=1e-5,
        help="relative tolerance of loss and grad norm (default 1e-5)",
    )
    p.add_argument(
        "--grad-rtol",
        type=float,
        default=1e-4,
        help="tolerance of each gradient tensor: |g - reference| over |reference| "
        "(L2 norms; default 1e-4)",
    )
    p.add_argument(
        "--grad-atol",
        type=float,
        default=1e-9,
        help="absolute tolerance added to --grad-rtol's (default 1e-9)",
    )
    p.add_argument(
        "--reference",
        default="",
        help="flags of the reference run, quoted (default: one process, no "
        "parallelism), e.g. '--nproc-per-node 2 --tensor-model-parallel-size 2'",
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="where the initial weights and gradients go (an empty or new "
        "directory, kept); default: a temporary one, removed",
    )
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)  # set for launched ranks
    return p


def split(argv: Sequence[str]) -> tuple[argparse.Namespace, str, list[str]]:
    """(verify's options, the training command, its flags); UsageError when unusable."""
    at = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    if at is None:
        raise UsageError(
            "name the training command after verify's options: "
            "`anyspeed verify [OPTIONS] pretrain|posttrain FLAGS...`"
        )
    p = _parser()
    try:
        opts = p.parse_args(list(argv[:at]))
    except SystemExit as exc:
        raise UsageError(
            f"unrecognized verify options: {' '.join(argv[:at])} (see `{PROG} --help`)"
        ) from exc
    if opts.steps < 1:
        raise UsageError(f"--steps {opts.steps}: compare at least 1 step")
    for name in ("rtol", "grad_rtol", "grad_atol"):
        if not getattr(opts, name) >= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be a number >= 0")
    return opts, argv[at], list(argv[at + 1 :])


def _check(argv: list[str], command: str, which: str) -> tuple[Any, list[str]]:
    from anyspeed.stages.prepare import prepare

    try:
        run, rest = prepare(argv, "launcher", command)
    except UsageError as exc:
        raise UsageError(f"the {which} run: {exc}") from None
    if run.layout.torch_fsdp2 or run.layout.megatron_fsdp:
        raise UsageError(
            f"the {which} run: anyspeed verify compares the gradients of DDP layouts; "
            "--use-torch-fsdp2 and --use-megatron-fsdp are not compared yet (their losses and "
            "grad norms are checked against the distributed optimizer in the tests)"
        )
    return run, rest


def _reference(text: str) -> list[str]:
    """``--reference``'s flags, split as a shell would (one line for an unclosed quote)."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"--reference {text!r}: {exc} (quote it as a shell would)") from None


def _workdir(opts: argparse.Namespace) -> tuple[str, bool]:
    if opts.workdir is None:
        return tempfile.mkdtemp(prefix="anyspeed-verify-"), True
    if os.path.exists(opts.workdir) and (
        not os.path.isdir(opts.workdir) or os.listdir(opts.workdir)
    ):
        raise UsageError(
            f"--workdir {opts.workdir!r} is not an empty directory (give a new "
            "one: verify writes weights and gradients there)"
        )
    try:
        os.makedirs(opts.workdir, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=opts.workdir)  # noqa: SIM115 - only a probe
        probe.close()
    except OSError as exc:
        raise UsageError(
            f"--workdir {opts.workdir!r} cannot be written ({exc.strerror or exc}); give a "
            "writable directory"
        ) from None
    return opts.workdir, False


def _describe(run: Any) -> str:
    lay, n = run.layout, run.world
    moe = f" EP={lay.ep} ETP={lay.expert_tp}" if run.model.is_moe else ""
    return (
        f"TP={lay.tp} PP={lay.pp} {lay.schedule} CP={lay.cp} DP={lay.dp(n)}{moe} "
        f"SP={lay.sequence_parallel} distopt={lay.distributed_optimizer} ({n} "
        f"process{'es' if n > 1 else ''})"
    )


def _launch(role: str, n: int, workdir: str, command: str, argv: list[str]) -> int:
    from anyspeed.launch import supervise, torchrun_command, torchrun_env

    cmd = torchrun_command(
        n, "anyspeed", ["verify", "--role", role, "--workdir", workdir, command, *argv]
    )
    return supervise(cmd, torchrun_env(n), PROG)


def _rank(opts: argparse.Namespace, command: str, argv: list[str]) -> int:
    """A launched rank: the training command with the verify hook."""
    from anyspeed.commands.train import main as train_main
    from anyspeed.verify.hook import VerifyHook

    return train_main(argv, command, hooks=[VerifyHook(opts.role, opts.workdir)])


def _steps(workdir: str, role: str) -> list[dict[str, Any]]:
    with open(os.path.join(workdir, f"{role}.json"), encoding="utf-8") as f:
        return json.load(f)["steps"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``anyspeed verify`` (and of its launched ranks)."""
    from anyspeed.verify.hook import LAYOUT, REFERENCE
    from anyspeed.verify.report import Tolerance, command_lines, verdict

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _parser().print_help()
        return 0
    try:
        opts, command, train_argv = split(argv)
        if opts.role is not None:
            return _rank(opts, command, train_argv)
        layout_argv, ref_argv = command_lines(train_argv, opts.steps, _reference(opts.reference))
        layout_run, layout_argv = _check(layout_argv, command, "layout's")
        ref_run, ref_argv = _check(ref_argv, command, "reference")
        if ref_run.args.global_batch_size != layout_run.args.global_batch_size:
            raise UsageError(
                "--reference may not change --global-batch-size (the runs must "
                "train on the same batches)"
            )
        workdir, temporary = _workdir(opts)
    except UsageError as exc:
        return report(PROG, exc)
    print(
        f"{PROG}: {opts.steps} steps of the reference, {_describe(ref_run)}, then of the "
        f"layout, {_describe(layout_run)}, from the same initial weights and batches "
        f"(dropout off; weights and gradients under {workdir})",
        flush=True,
    )
    try:
        for role, run, args in ((REFERENCE, ref_run, ref_argv), (LAYOUT, layout_run, layout_argv)):
            rc = _launch(role, run.world, workdir, command, args)
            if rc:
                print(
                    f"{PROG}: the {role} run stopped (exit {rc}); nothing compared", file=sys.stderr
                )
                return rc
        tol = Tolerance(opts.rtol, opts.grad_rtol, opts.grad_atol)
        lines, ok = verdict(_steps(workdir, REFERENCE), _steps(workdir, LAYOUT), tol)
    finally:
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)
    for line in lines:
        print(line)
    return 0 if ok else 1
