"""Hugging Face export after each save (MindSpeed-LLM's ``--enable-mg2hf-convert``): a run that
saves Megatron checkpoints also leaves its latest weights as a Hugging Face directory, ready for
transformers or vLLM, without a separate ``anyspeed convert``.

After every checkpoint is committed (``--only-convert-last-checkpoint``: after the last
iteration's only), global rank 0 runs ``anyspeed convert`` on it (a process of its own) into
``--hf-save-dir`` (default: ``<--save>_hf``): written beside it first and swapped in whole, so
the directory always holds one complete export, the latest. A LoRA run exports the base merged
with its adapters. The other ranks wait at a barrier. An export that fails says so in one line
and the run goes on: its Megatron checkpoint is saved, and the line gives the command to
convert it later.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from anyspeed.errors import UsageError
from anyspeed.training.loop import Hook

if TYPE_CHECKING:
    from anyspeed.training.loop import LoopState
    from anyspeed.training.run import Run


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Hugging Face export (MindSpeed-LLM's names)")
    g.add_argument(
        "--enable-mg2hf-convert",
        action="store_true",
        help="after each save, also write the checkpoint as a Hugging Face directory "
        "(--hf-save-dir)",
    )
    g.add_argument(
        "--only-convert-last-checkpoint",
        action="store_true",
        help="with --enable-mg2hf-convert: export only the last iteration's checkpoint",
    )
    g.add_argument(
        "--hf-save-dir", default=None, help="where the export goes (default: <--save>_hf)"
    )
    g.add_argument(
        "--hf-cfg-dir",
        default=None,
        help="a Hugging Face directory whose tokenizer files the export copies (default: "
        "--load when it is one, else --tokenizer-name-or-path)",
    )


@dataclass(frozen=True)
class Export:
    """The checked export flags."""

    save_dir: str
    cfg_dir: str | None
    only_last: bool


def from_args(args: argparse.Namespace, hf_load: str | None) -> Export | None:
    """The export of a run (``hf_load``: the Hugging Face directory --load named), checked in
    one line each before start; None: off."""
    if not getattr(args, "enable_mg2hf_convert", False):
        if getattr(args, "only_convert_last_checkpoint", False) or args.hf_save_dir:
            raise UsageError(
                "--only-convert-last-checkpoint and --hf-save-dir set the Hugging Face "
                "export: add --enable-mg2hf-convert"
            )
        return None
    if not args.save:
        raise UsageError("--enable-mg2hf-convert exports what --save writes: pass --save DIR")
    save_dir = args.hf_save_dir or args.save.rstrip("/\\") + "_hf"
    save, out = os.path.abspath(args.save), os.path.abspath(save_dir)
    if os.path.commonpath([save, out]) == save:
        raise UsageError(
            f"--hf-save-dir {save_dir} is --save or inside it: give the export a directory "
            "of its own"
        )
    cfg = args.hf_cfg_dir or hf_load
    tok = getattr(args, "tokenizer_name_or_path", None)
    if cfg is None and tok and os.path.isdir(tok):
        cfg = tok
    if cfg is not None and not os.path.isdir(cfg):
        raise UsageError(f"--hf-cfg-dir {cfg}: not a directory")
    return Export(save_dir, cfg, bool(args.only_convert_last_checkpoint))


class HFExport(Hook):
    """Converts each committed checkpoint (or the last) into the export directory."""

    def __init__(self, run: Run, export: Export, lora: Any = None) -> None:
        self.run, self.export, self.lora = run, export, lora

    def on_checkpoint_saved(self, state: LoopState, path: str) -> None:
        import torch.distributed as dist

        from anyspeed.distributed.process import is_rank0, print0

        last = state.iteration >= self.run.args.train_iters
        if self.export.only_last and not last:
            return
        if is_rank0():
            t = time.perf_counter()
            why = self._convert()
            if why is None:
                print0(
                    f" exported iteration {state.iteration} as Hugging Face to "
                    f"{self.export.save_dir} ({time.perf_counter() - t:.1f} s)"
                )
            else:
                load = self.run.args.save if self.lora is None else self.run.load
                lora = "" if self.lora is None else f" --lora-load {self.run.args.save} ..."
                print0(
                    f"{self.run.prog}: warning: the Hugging Face export of iteration "
                    f"{state.iteration} failed ({why}); convert it later: anyspeed convert "
                    f"--load-model-type mg --save-model-type hf --load-dir {load}{lora} "
                    "--save-dir DIR"
                )
            key = "exported" if why is None else "export_failed"
            state.history.setdefault(key, []).append(state.iteration)  # rank 0's record
        if dist.is_initialized():
            dist.barrier()

    def _convert(self) -> str | None:
        """Convert the latest checkpoint beside the export directory (``anyspeed convert`` in
        a process of its own: it builds a one-rank Megatron), then swap it in; what went wrong
        in one line, or None."""
        import subprocess
        import sys

        final = self.export.save_dir
        staged, old = final + ".writing", final + ".old"
        shutil.rmtree(staged, ignore_errors=True)
        cmd = [sys.executable, "-m", "anyspeed", "convert", "--save-dir", staged]
        cmd += "--load-model-type mg --save-model-type hf".split()
        if self.lora is None:
            cmd += ["--load-dir", self.run.args.save]
        else:  # the base (the run's --load) merged with the saved adapters
            lora = self.lora
            cmd += ["--load-dir", self.run.load, "--lora-load", self.run.args.save]
            cmd += ["--lora-r", str(lora.r), "--lora-alpha", str(lora.alpha)]
            cmd += ["--lora-target-modules", *lora.target_modules]
        if self.export.cfg_dir:
            cmd += ["--hf-cfg-dir", self.export.cfg_dir]
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
        env = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            shutil.rmtree(staged, ignore_errors=True)
            lines = [ln for ln in done.stderr.splitlines() if ln.startswith("anyspeed convert")]
            tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            return (lines or tail)[-1]
        shutil.rmtree(old, ignore_errors=True)
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old, ignore_errors=True)
        return None


# what torchrun sets for its ranks: a conversion process is a world of its own
_LAUNCHER_ENV = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
