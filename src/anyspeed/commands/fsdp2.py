"""``anyspeed fsdp2 CONFIG.yaml [--nproc-per-node N] [--section.key VALUE ...]``: train a
transformers model with PyTorch's FSDP2 (``fully_shard``), configured by a YAML file.

Everything that can be wrong is checked before any process group starts: the configuration's
keys and values, the model directory (no remote code), the data files, the sharding against
the number of ranks, the checkpoint to resume; then the per-rank memory estimate is printed and
the ranks are launched (torchrun) or the one process trains here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from anyspeed.errors import UsageError, report

PROG = "anyspeed fsdp2"
USAGE = (
    "usage: anyspeed fsdp2 CONFIG.yaml [--nproc-per-node N] [--section.key VALUE ...]\n\n"
    "Train a transformers model directory with FSDP2, as CONFIG.yaml says (sections model, "
    "data, parallel, training: docs/fsdp2.md). --section.key VALUE overrides one key, e.g. "
    "--training.lr 1e-4."
)


def _split(argv: list[str]) -> tuple[str, int | None, list[str]]:
    """(config path, --nproc-per-node, the overrides)."""
    if not argv or argv[0].startswith("-"):
        raise UsageError("the first argument is the YAML configuration file")
    path, rest, nproc = argv[0], argv[1:], None
    for flag in ("--nproc-per-node", "--nproc_per_node"):
        if flag in rest:
            i = rest.index(flag)
            if i + 1 >= len(rest) or not rest[i + 1].isdigit() or int(rest[i + 1]) < 1:
                raise UsageError(f"{flag} needs a positive number of processes")
            nproc = int(rest[i + 1])
            rest = rest[:i] + rest[i + 2 :]
    return path, nproc, rest


def check(argv: list[str]) -> tuple[object, int, str, object]:
    """The checked configuration, the number of ranks, the estimate line and the opened data
    source (UsageError)."""
    from anyspeed.fsdp import checkpoint as ckpt
    from anyspeed.fsdp import config as C
    from anyspeed.fsdp import model as M
    from anyspeed.fsdp.estimate import estimate

    path, nproc, rest = _split(argv)
    cfg = C.load(path, C.parse_overrides(rest))
    launched = os.environ.get("WORLD_SIZE")
    world = int(launched) if launched else (nproc or 1)
    if launched and nproc not in (None, world):
        raise UsageError(f"--nproc-per-node {nproc} but {world} ranks were launched")
    if cfg.model.trust_remote_code:
        raise UsageError(
            "model.trust_remote_code: anyspeed fsdp2 runs no remote code (set it to false)"
        )
    M.read_config(cfg.model.model_name_or_path)
    C.layout(cfg, world)
    meta = M.load_model(cfg, meta=True)
    M.freeze(meta, cfg.model.freeze)
    if cfg.parallel.cp_size > 1:
        from anyspeed.fsdp import ulysses

        if M.is_multimodal(meta):
            raise UsageError(
                "parallel.cp_size > 1 is for text models: a vision-language model trains "
                "with cp_size 1"
            )
        ulysses.check(meta.config, cfg.parallel.cp_size)
    if cfg.parallel.cpu_offload:
        from anyspeed.device import detect

        if detect().is_cpu:
            raise UsageError(
                "parallel.cpu_offload needs an accelerator: on the CPU every tensor already "
                "lives in host memory"
            )
    ckpt.resolve(cfg.training.resume_from_checkpoint, cfg.training.output_dir)
    from anyspeed.fsdp.data import open_source

    mm = {"image_dir": cfg.data.image_dir, "max_pixels": cfg.data.image_max_pixels}
    source = open_source(cfg.data.dataset, cfg.data.cutoff_len, cfg.model.model_name_or_path, mm)
    return cfg, world, estimate(meta, cfg, world).line(world), source


def main(argv: Sequence[str]) -> int:
    """The command: check, print the estimate, launch or train here."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    from anyspeed.distributed.process import is_rank0
    from anyspeed.launch import reports_here

    try:
        cfg, world, line, source = check(argv)
    except (UsageError, ValueError) as exc:
        return report(PROG, exc) if is_rank0() else 2
    if reports_here():
        print(f"{PROG}: {line}", flush=True)
    if "WORLD_SIZE" not in os.environ and world > 1:
        from anyspeed.launch import supervise, torchrun_command, torchrun_env

        return supervise(
            torchrun_command(world, "anyspeed", ["fsdp2", *argv]), torchrun_env(world), PROG
        )
    return _train_here(cfg, source)


def _train_here(cfg: object, source: object) -> int:
    import torch.distributed as dist

    from anyspeed.fsdp.run import train
    from anyspeed.launch import single_process_env

    saved = dict(os.environ)
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(single_process_env())
    try:
        train(cfg, source)  # type: ignore[arg-type]  # the source checked above, not reopened
    except (UsageError, ValueError) as exc:
        from anyspeed.distributed.process import is_rank0

        return report(PROG, exc, code=1) if is_rank0() else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
    return 0
