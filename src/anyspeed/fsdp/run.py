"""What each rank of ``anyspeed fsdp2`` does: start the process group, build and shard the
model, resume, train with the same loop, log line, metrics and progress as ``anyspeed
pretrain``, save, and export a transformers directory at the end."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from anyspeed.distributed.process import print0
from anyspeed.fsdp import checkpoint as ckpt
from anyspeed.fsdp.config import FSDPConfig, layout
from anyspeed.training.loop import Hook, LoopState

PROG = "anyspeed fsdp2"


class SaveHook(Hook):
    """A checkpoint every ``save_steps`` and at the end (when ``output_dir`` is set)."""

    def __init__(self, cfg: FSDPConfig) -> None:
        self.t = cfg.training
        self.last: int | None = None

    def on_start(self, state: LoopState) -> None:
        self.last = state.iteration if state.iteration else None

    def save(self, state: LoopState) -> None:
        t0 = time.perf_counter()
        path = ckpt.save(
            self.t.output_dir, state.iteration, state.trainer, state.scheduler, state.consumed
        )
        state.history["saved"].append(state.iteration)
        self.last = state.iteration
        print0(f" saved checkpoint {path} ({time.perf_counter() - t0:.1f} s)")

    def after_step(self, state: LoopState, out: dict[str, Any]) -> None:
        every = self.t.save_steps
        if self.t.output_dir and every and state.iteration % every == 0:
            self.save(state)

    def on_end(self, state: LoopState, completed: bool) -> None:
        if self.t.output_dir and self.last != state.iteration:
            self.save(state)


def _groups(world: int, cp: int) -> Any:
    """This rank's Ulysses group (consecutive ranks), or None without Ulysses."""
    if cp == 1:
        return None
    mine = None
    for start in range(0, world, cp):
        group = dist.new_group(list(range(start, start + cp)))
        if dist.get_rank() // cp == start // cp:
            mine = group
    return mine


def _log_args(cfg: FSDPConfig, gbs: int) -> SimpleNamespace:
    """What the shared log hook reads, in ``anyspeed pretrain``'s names."""
    t = cfg.training
    return SimpleNamespace(
        train_iters=t.max_steps,
        log_interval=t.logging_steps,
        global_batch_size=gbs,
        seq_length=cfg.data.cutoff_len,
        fp16=False,
        no_progress_bar=t.no_progress_bar,
        tensorboard_dir=t.tensorboard_dir or None,
        metrics_file=t.metrics_file or None,
    )


def build(cfg: FSDPConfig, device: torch.device) -> tuple[Any, Any, Any]:
    """The sharded model, its trainer and schedule, and this rank's Ulysses group."""
    from torch.distributed.device_mesh import init_device_mesh

    from anyspeed.fsdp import model as M
    from anyspeed.fsdp import ulysses
    from anyspeed.fsdp.trainer import FSDPTrainer, Schedule

    world = dist.get_world_size()
    cp = cfg.parallel.cp_size
    cp_group = _groups(world, cp)
    model = M.load_model(cfg)
    M.freeze(model, cfg.model.freeze)
    if cp > 1:
        ulysses.install(model, cp_group)
    if device.type != "cpu":
        model.to(device)
    model.train()
    mesh = init_device_mesh(device.type, (world,))
    M.shard(model, cfg, mesh)
    trainer = FSDPTrainer(model, cfg.training, cp_group, device)
    return trainer, Schedule(trainer.optimizer, cfg.training), cp_group


def train(cfg: FSDPConfig, source: Any = None) -> dict[str, Any]:
    """Train ``cfg`` on this rank (the process group is started here); the history.
    ``source``: the data source already opened (and checked) for ``cfg``, else it is opened."""
    from anyspeed.device import detect, torch_device
    from anyspeed.device.flops import peak
    from anyspeed.fsdp.data import open_source, rank_batches
    from anyspeed.fsdp.estimate import flops_per_token
    from anyspeed.training import hooks as H
    from anyspeed.training.loop import run as run_loop
    from anyspeed.training.metrics import peak_memory_bytes

    info = detect()
    if not info.is_cpu:
        getattr(torch, info.type).set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend=info.dist_backend, timeout=timedelta(minutes=10))
    device = torch_device()
    world, dp = layout(cfg, dist.get_world_size())
    t, p = cfg.training, cfg.parallel
    torch.manual_seed(t.seed)
    trainer, scheduler, _ = build(cfg, device)
    gbs = t.per_device_train_batch_size * dp * t.gradient_accumulation_steps
    start, consumed = 0, 0
    resume = ckpt.resolve(t.resume_from_checkpoint, t.output_dir)
    if resume:
        saved = ckpt.load(resume, trainer, scheduler)
        start, consumed = int(saved["step"]), int(saved["consumed_samples"])
        print0(f"{PROG}: resumed from {resume} (step {start}, {consumed} samples)")
    if source is None:
        mm = {"image_dir": cfg.data.image_dir, "max_pixels": cfg.data.image_max_pixels}
        path, seq = cfg.data.dataset, cfg.data.cutoff_len
        source = open_source(path, seq, cfg.model.model_name_or_path, mm)
    batches = rank_batches(
        source,
        consumed,
        micro=t.per_device_train_batch_size,
        accum=t.gradient_accumulation_steps,
        dp=dp,
        dp_rank=dist.get_rank() // p.cp_size,
        multiple=p.cp_size,
        seed=t.seed,
        shuffle=cfg.data.shuffle,
    )
    state = LoopState(trainer, scheduler, t.max_steps, gbs, iteration=start, consumed=consumed)
    args = _log_args(cfg, gbs)
    run = SimpleNamespace(args=args, prog=PROG)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(p.param_dtype, torch.float32)
    rate = peak(dtype).flops
    reporter = H.Reporter(args, start)
    print0(
        f"{PROG}: {world} ranks (FSDP over {world}, Ulysses {p.cp_size}, {dp} data-parallel), "
        f"global batch {gbs}, {len(source)} samples, steps {start}..{t.max_steps}"
    )
    hooks = [
        H.NanGuard(None),
        H.LogHook(
            reporter,
            run,
            flops_per_token(trainer.model, cfg),
            None if rate is None else rate * world,
        ),
        SaveHook(cfg),
    ]
    try:
        run_loop(state, batches, hooks)
    finally:
        reporter.close()
    if t.save_hf_weights and t.output_dir:
        out = os.path.join(t.output_dir, "hf")
        ckpt.export_hf(trainer.model, cfg.model.model_name_or_path, out)
        print0(f"{PROG}: wrote the trained model to {out} (a transformers directory)")
    history = state.history
    history["peak_memory_bytes"] = peak_memory_bytes()
    history["trainer"] = trainer
    return history
