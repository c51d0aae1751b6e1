"""``--fp8-format`` on this machine, side by side in one run: time per step, activation bytes
saved for backward and the loss against the same training without FP8.

The 55M Qwen2.5-shaped benchmark model (8 layers, hidden 512), bf16 (or fp32), sequence 512,
micro-batch 4, on one process: each row trains ``--steps`` steps from the same initial weights
on the same synthetic batches; the first step is not timed. FP8 runs its GEMMs on
``torch._scaled_mm`` on a GPU with FP8 tensor cores; on a CPU they are emulated (FP8 values
multiplied in bf16), so the time there is the cost of checking a recipe's numerics, not a
speed-up. The activation bytes (the saved-tensor meter over one forward) and the loss are the
same on any device.

    python benchmarks/fp8.py [--steps 6] [--fp32] [--recipes tensorwise delayed]
"""

from __future__ import annotations

import argparse
import statistics
import time

from anyspeed.testing import run_distributed
from reuse_fp32 import MODELS

MODEL = MODELS["55m"]  # the 55M Qwen2.5-shaped benchmark model


def _saved_bytes(t) -> int:  # noqa: ANN001 - anyspeed's Trainer
    from anyspeed.features.memory.meter import SavedBytes
    from anyspeed.training import synthetic

    batch = synthetic.microbatches(t.model_config.vocab_size, t.cfg, 0)[0]
    chunk = t.model[0]
    with SavedBytes(exclude=list(chunk.parameters())) as meter:
        chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return meter.bytes


def rank(recipes: list[str], steps: int, bf16: bool) -> list[dict]:
    """Each row's median step time, saved bytes and losses (every row starts from the same
    weights: the same seed, CPU initialisation)."""
    from anyspeed import adaptor, quiet
    from anyspeed.features.fp8.settings import Fp8Settings
    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig
    from anyspeed.stages.pretrain.task import PretrainTask
    from anyspeed.training import synthetic
    from anyspeed.training.config import TrainConfig
    from anyspeed.training.step import Trainer

    quiet.install()
    rows = []
    for recipe in [None, *recipes]:
        adaptor.undo()
        adaptor.apply(argv=["--fp8-format", "hybrid", "--fp8-recipe", recipe] if recipe else [])
        fp8 = Fp8Settings(recipe=recipe) if recipe else None
        cfg = TrainConfig(bf16=bf16, seq_length=512, micro_batch_size=4, global_batch_size=4,
                          lr=3e-4, fp8=fp8)  # fmt: skip
        t = Trainer(ModelConfig(**MODEL), Layout(), cfg, PretrainTask())
        saved = _saved_bytes(t)
        losses, times = [], []
        for _ in range(steps):
            start = time.perf_counter()
            losses.append(synthetic.train_step(t)["loss"])
            times.append(time.perf_counter() - start)
        rows.append(dict(recipe=recipe or "none", s=statistics.median(times[1:]), saved=saved,
                         losses=losses))  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--fp32", action="store_true", help="fp32 weights instead of bf16")
    p.add_argument("--recipes", nargs="+", default=["tensorwise", "delayed"])
    args = p.parse_args()
    (rows,) = run_distributed(rank, 1, recipes=args.recipes, steps=args.steps,
                              bf16=not args.fp32, timeout=3600)  # fmt: skip
    base = rows[0]
    precision = "fp32" if args.fp32 else "bf16"
    print(f"55M Qwen2.5-shaped, {precision}, seq 512 x micro-batch 4, {args.steps} steps")
    for r in rows:
        drift = max(abs(a / b - 1) for a, b in zip(r["losses"], base["losses"], strict=True))
        loss = f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} (max rel. diff {drift:.1e})"
        step = f"{r['s']:6.2f} s/step ({r['s'] / base['s']:4.2f}x)"
        saved = f"saved {r['saved'] / 2**20:6.1f} MiB ({r['saved'] / base['saved']:4.2f}x)"
        print(f"  fp8 {r['recipe']:10} {step}  {saved}  {loss}")


if __name__ == "__main__":
    main()
