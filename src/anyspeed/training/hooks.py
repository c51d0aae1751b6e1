"""The loop's hooks: NaN guard, logging/metrics, evaluation, checkpoints, fault injection."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

from anyspeed.distributed.process import agree, is_rank0, print0
from anyspeed.training.loop import Hook, LoopState
from anyspeed.training.moe_metrics import log_fields


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite: the run stops without saving over good checkpoints."""


class NanGuard(Hook):
    """Stops the run at the first non-finite loss, naming the last good checkpoint."""

    def __init__(self, save_dir: str | None) -> None:
        self.save_dir = save_dir

    def after_step(self, state: LoopState, out: dict[str, Any]) -> None:
        if math.isfinite(out["loss"]):
            return
        from anyspeed.checkpoint.files import read_tracker

        state.notify("abort")
        good = read_tracker(self.save_dir) if self.save_dir else None
        raise NonFiniteLoss(
            f"loss is {out['loss']} at iteration {state.iteration}; stopping without saving"
            + (f" (last good checkpoint: iteration {good} in {self.save_dir})" if good else "")
        )


class Reporter:
    """Where a run's numbers go: rank 0's terminal (progress bar), TensorBoard, a JSON file."""

    def __init__(self, args: argparse.Namespace, start: int) -> None:
        from anyspeed.training.metrics import Progress, TensorBoard

        self.progress = Progress(args.train_iters, start, enabled=not args.no_progress_bar)
        self.tb = TensorBoard(args.tensorboard_dir if is_rank0() else None)
        self.metrics = open(args.metrics_file, "a") if args.metrics_file and is_rank0() else None

    def record(self, values: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(values) + "\n")
            self.metrics.flush()

    def close(self) -> None:
        self.progress.clear()
        self.tb.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


class LogHook(Hook):
    """Megatron-LM's iteration line every ``--log-interval`` steps, plus metrics and TB."""

    def __init__(
        self,
        reporter: Reporter,
        run: Any,
        flops_per_token: float,
        peak_flops: float | None,
        label: str = "lm loss",
    ) -> None:
        self.r, self.args, self.prog = reporter, run.args, run.prog
        self.label = label  # the task's loss name (pretraining: Megatron-LM's "lm loss")
        self.flops_tok, self.peak = flops_per_token, peak_flops
        self.loss, self.n, self.t0 = 0.0, 0, time.perf_counter()
        self.tokens: int | None = 0  # processed since the last line (None: a step did not say)
        self.metrics: dict[str, float] = {}
        self.warned = False

    def mfu(self, flops: float) -> float | None:
        """Achieved / peak FLOP/s; None when the peak is unknown, or (with one warning) when
        the achieved rate exceeds it: then the peak is wrong and no figure would be honest."""
        if self.peak is None:
            return None
        if flops <= self.peak:
            return flops / self.peak
        if not self.warned:
            self.warned = True
            print0(
                f"{self.prog}: warning: {flops / 1e12:.3g} TFLOP/s achieved exceeds "
                f"the peak {self.peak / 1e12:.3g} TFLOP/s measured for this device, so MFU is "
                "not shown (set ANYSPEED_PEAK_TFLOPS to its real peak)"
            )
        return None

    def on_abort(self, state: LoopState) -> None:
        self.r.progress.clear()

    def after_step(self, state: LoopState, out: dict[str, Any]) -> None:
        self.loss += out["loss"]
        self.n += 1
        step_tokens = out.get("tokens")
        self.tokens = (
            None if self.tokens is None or step_tokens is None else self.tokens + step_tokens
        )
        for k, v in out.get("metrics", {}).items():
            self.metrics[k] = self.metrics.get(k, 0.0) + v
        it = state.iteration
        self.r.progress.update(it)
        if it % self.args.log_interval and it != state.train_iters:
            return
        from anyspeed.training.metrics import peak_memory_bytes

        dt = (time.perf_counter() - self.t0) / self.n
        # the tokens the steps processed (padding to a batch's longest included: it is computed)
        # else every sample at --seq-length, which overstated a variable-length SFT run's rate
        per_step = self.tokens / self.n if self.tokens else None
        tps = (per_step or self.args.global_batch_size * self.args.seq_length) / dt
        tflops = tps * self.flops_tok / 1e12
        mem = peak_memory_bytes() / 2**30
        opt = state.trainer.optimizer
        scale = float(opt.get_loss_scale()) if self.args.fp16 else None
        loss = self.loss / self.n
        mfu = self.mfu(tflops * 1e12)
        moe_text, moe = log_fields(out["moe"]) if "moe" in out else ("", {})
        named = {k: v / self.n for k, v in self.metrics.items()}
        moe_text = "".join(f"{k}: {v:.6E} | " for k, v in named.items()) + moe_text
        self.r.progress.clear()
        print0(
            f" iteration {it:>7d}/{state.train_iters} | consumed samples {state.consumed:>9d} | "
            f"elapsed time per iteration (ms): {dt * 1000:.1f} | learning rate: {out['lr']:.6E} | "
            f"{self.label}: {loss:.6E} | {moe_text}"
            + (f"loss scale: {scale:.1f} | " if scale is not None else "")
            + f"grad norm: {out['grad_norm']:.3f} | tokens/s: {tps:,.0f} | "
            f"TFLOP/s: {tflops:.3f} | MFU: {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
            f"peak mem: {mem:.2f} GiB/rank | {self.r.progress.tag(it)}"
        )
        self.r.record(
            {
                "iteration": it,
                self.label.replace(" ", "_"): loss,
                "lr": out["lr"],
                "skipped": len(state.history["skipped"]),
                "grad_norm": out["grad_norm"],
                "tokens_per_s": tps,
                "tflops": tflops,
                "mfu": mfu,
                "peak_mem_gib": mem,
                "ms_per_iter": dt * 1000,
                **named,
                **moe,
                **({"expert_load_per_layer": out["moe"]["load_per_layer"]} if moe else {}),
            }
        )
        self.r.tb.scalars(
            {
                self.label.replace(" ", "-"): loss,
                "learning-rate": out["lr"],
                "grad-norm": out["grad_norm"],
                "tokens-per-sec": tps,
                "tflops": tflops,
                "mem-peak-gib": mem,
                **({} if mfu is None else {"mfu": mfu}),
                **named,
                **{f"moe/{k}": v for k, v in moe.items()},
            },
            it,
        )
        self.loss, self.n, self.t0 = 0.0, 0, time.perf_counter()
        self.tokens = 0
        self.metrics = {}

    def on_end(self, state: LoopState, completed: bool) -> None:
        self.r.progress.clear()


class EvalHook(Hook):
    """Validation every ``--eval-interval`` steps and at the end; the test split at the end."""

    def __init__(
        self, reporter: Reporter, run: Any, task: Any, valid: Any, test: Any, device: Any
    ) -> None:
        self.r, self.run, self.args, self.task = reporter, run, run.args, task
        self.valid_ds, self.test_ds, self.device = valid, test, device
        self.valid_iter = None

    def on_start(self, state: LoopState) -> None:
        if self.valid_ds is not None:
            self.valid_iter = self.task.batches(
                self.valid_ds, self.run, state.consumed_valid, self.device, state.trainer
            )

    def _evaluate(self, state: LoopState, label: str, source: Any) -> float | None:
        if source is None or not self.args.eval_iters:
            return None
        losses = []
        for _ in range(self.args.eval_iters):
            mbs = next(source, None)
            if mbs is None:
                break
            losses.append(state.trainer.evaluate(mbs))
        if not losses:
            return None
        loss = sum(losses) / len(losses)
        ppl = math.exp(min(loss, 20.0))
        print0(
            f" {label} loss at iteration {state.iteration} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {ppl:.6E}"
        )
        self.r.tb.scalars({f"lm-loss-{label.split()[0]}": loss}, state.iteration)
        return loss

    def _validate(self, state: LoopState) -> None:
        v = self._evaluate(state, "validation", self.valid_iter)
        if v is not None:
            state.history["valid"].append((state.iteration, v))
            state.consumed_valid += self.args.eval_iters * self.args.global_batch_size

    def after_step(self, state: LoopState, out: dict[str, Any]) -> None:
        every = self.args.eval_interval
        if every and state.iteration % every == 0 and state.iteration != state.train_iters:
            self._validate(state)

    def on_end(self, state: LoopState, completed: bool) -> None:
        if not completed or state.train_iters <= state.start_iteration:
            return
        self._validate(state)
        if self.test_ds is not None:
            source = self.task.batches(self.test_ds, self.run, 0, self.device, state.trainer)
            state.history["test"] = self._evaluate(state, "test", source)


class CheckpointHook(Hook):
    """Saves every ``--save-interval`` steps and at the end; stops at ``--exit-interval``. At
    the start, rank 0 clears the ``--save`` directory of what killed runs left half-written."""

    def __init__(self, run: Any, extra: dict[str, Any]) -> None:
        self.run, self.args, self.extra = run, run.args, extra
        self.last_saved: int | None = None

    def on_start(self, state: LoopState) -> None:
        resumed = self.run.load and not self.args.finetune
        self.last_saved = state.iteration if resumed else None
        if not self.args.save:
            return

        from anyspeed.checkpoint.errors import CheckpointError
        from anyspeed.checkpoint.files import DirectoryInUse, lock_dir, remove_stale

        error = None
        if is_rank0():  # one run per --save directory; then what killed runs left there
            try:
                lock_dir(self.args.save)
                remove_stale(self.args.save)
            except (DirectoryInUse, OSError) as exc:
                error = f"--save {exc}" if isinstance(exc, DirectoryInUse) else str(exc)
        error = agree(error)
        if error:
            raise CheckpointError(error)

    def save(self, state: LoopState) -> None:
        from anyspeed.checkpoint.save import save_checkpoint

        args, t = self.args, time.perf_counter()
        extra = dict(
            self.extra,
            consumed_train_samples=state.consumed,
            consumed_valid_samples=state.consumed_valid,
        )
        optimizer = None if args.no_save_optim else state.trainer.optimizer
        path = save_checkpoint(
            args.save,
            state.iteration,
            state.trainer.model,
            optimizer,
            state.scheduler,
            extra,
            save_rng=not getattr(args, "no_save_rng", False),
            before_commit=lambda tmp: state.notify("checkpoint_written", tmp),
        )
        state.history["saved"].append(state.iteration)
        self.last_saved = state.iteration
        print0(f" saved checkpoint {path} ({time.perf_counter() - t:.1f} s)")
        state.notify("checkpoint_saved", path)  # committed (e.g. the Hugging Face export)

    def after_step(self, state: LoopState, out: dict[str, Any]) -> None:
        every = self.args.save_interval
        if self.args.save and every and state.iteration % every == 0:
            self.save(state)

    def should_stop(self, state: LoopState) -> bool:
        every = self.args.exit_interval
        return bool(every and state.iteration % every == 0)

    def on_end(self, state: LoopState, completed: bool) -> None:
        if self.args.save and self.last_saved != state.iteration:
            self.save(state)
        self.on_abort(state)

    def on_abort(self, state: LoopState) -> None:
        if self.args.save and is_rank0():
            from anyspeed.checkpoint.files import unlock_dir

            unlock_dir(self.args.save)


class FaultInjection(Hook):
    """Faults for tests: a NaN weight before iteration ``nan_at``; the process killed after the
    ``crash_on_save``-th checkpoint's data is written but before it is renamed into place."""

    def __init__(self, nan_at: int | None = None, crash_on_save: int | None = None) -> None:
        self.nan_at, self.crash_on_save, self.saves = nan_at, crash_on_save, 0

    def before_step(self, state: LoopState) -> None:
        if self.nan_at is not None and state.iteration + 1 == self.nan_at:
            import torch

            with torch.no_grad():
                next(state.trainer.model[0].parameters()).fill_(float("nan"))

    def on_checkpoint_written(self, state: LoopState, tmp_dir: str) -> None:
        self.saves += 1
        if self.saves == self.crash_on_save:
            os._exit(17)
