"""Memory features on the ~55M-parameter Qwen2.5-architecture GPT: speed, memory, longest sequence.

One fresh process per feature (so each peak RSS is its own), fp32, micro-batch 1, one CPU
process. Per feature it prints tokens/s, the peak RSS over the timed steps, the bytes autograd
saved for backward in the first step (the bytes meter), what ``anyspeed memory`` estimates for
them, and the longest sequence whose estimated rank memory fits ``--budget-gib`` (activations
grow linearly with the sequence under the fused attention, so the estimator answers this
without running every length; the measured row shows it agrees at the run's length).

    python benchmarks/memory.py [--seq-length 2048] [--steps 2] [--budget-gib 4]
"""

from __future__ import annotations

import argparse
import time

from anyspeed.testing import run_distributed

MODEL = dict(num_layers=8, hidden_size=512, num_attention_heads=8, num_query_groups=2,
             ffn_hidden_size=1408, vocab_size=32000, add_qkv_bias=True,
             rotary_base=1000000)  # fmt: skip
ACT, NORM = ["--recompute-activation-function"], ["--recompute-norm"]
FEATURES = {  # name: (feature flags, Megatron recompute fields)
    "none": ([], {}),
    "recompute-activation-function": (ACT, {}),
    "recompute-norm": (NORM, {}),
    "activation + norm": (ACT + NORM, {}),
    "selective core_attn+mlp": ([], dict(granularity="selective", modules=["core_attn", "mlp"])),
    "full uniform 1": ([], dict(granularity="full", method="uniform", num_layers=1)),
    "swap-attention (CPU no-op)": (["--swap-attention"], {}),
}


def feature_run(recompute: dict, seq: int, steps: int) -> dict:
    """One rank: build, meter the first step, time ``steps`` more; peak RSS over all."""
    from anyspeed.device import cpu_cuda
    from anyspeed.features.memory.meter import FirstForwardMeter
    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig
    from anyspeed.stages.pretrain.task import PretrainTask
    from anyspeed.training.config import TrainConfig
    from anyspeed.training.step import Trainer
    from anyspeed.training.synthetic import train_step

    cfg = TrainConfig(seq_length=seq, micro_batch_size=1, global_batch_size=1,
                      recompute=recompute)  # fmt: skip
    trainer = Trainer(ModelConfig(**MODEL), Layout(), cfg, PretrainTask())
    cpu_cuda.reset_peak_memory_stats()
    meter = FirstForwardMeter(trainer.model)
    train_step(trainer)
    t0 = time.perf_counter()
    losses = [train_step(trainer)["loss"] for _ in range(steps)]
    dt = (time.perf_counter() - t0) / steps
    return {"tokens_per_s": seq / dt, "peak_rss": cpu_cuda.max_memory_allocated(),
            "saved": meter.bytes, "loss": losses[-1]}  # fmt: skip


def _options(flags: list[str], recompute: dict, seq: int):
    from anyspeed.models.memory import Options
    from anyspeed.models.recompute import Recompute

    return Options(seq_length=seq, micro_batch_size=1, recompute=Recompute(**recompute),
                   recompute_activation=None if "--recompute-activation-function" in flags
                   else 0, recompute_norm=None if "--recompute-norm" in flags else 0)  # fmt: skip


def longest_fitting(flags: list[str], recompute: dict, budget: float) -> int:
    """The longest sequence (a multiple of 256) whose estimated rank memory fits ``budget``."""
    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig
    from anyspeed.models.memory import estimate

    model, seq = ModelConfig(**MODEL), 0
    while estimate(model, Layout(), 1, _options(flags, recompute, seq + 256)).total <= budget:
        seq += 256
    return seq


def main() -> None:
    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig
    from anyspeed.models.memory import estimate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--budget-gib", type=float, default=4.0)
    a = p.parse_args()
    mib, seq = 2**20, a.seq_length
    print(f"Qwen2.5-architecture GPT, {ModelConfig(**MODEL).num_parameters() / 1e6:.0f}M "
          f"parameters, seq {seq}, fp32, micro-batch 1, 1 CPU process; longest sequence: "
          f"estimated for {a.budget_gib:g} GiB per rank")  # fmt: skip
    print(f"{'feature':<28} {'tokens/s':>9} {'vs none':>8} {'peak RSS MiB':>13} "
          f"{'saved MiB':>10} {'estimate':>9} {'vs none':>8} {'longest seq':>12}")  # fmt: skip
    base = None
    for name, (flags, recompute) in FEATURES.items():
        r = run_distributed(feature_run, 1, timeout=1800, argv=flags, recompute=recompute,
                            seq=seq, steps=a.steps)[0]  # fmt: skip
        est = estimate(ModelConfig(**MODEL), Layout(), 1, _options(flags, recompute, seq))
        base = base or r
        longest = longest_fitting(flags, recompute, a.budget_gib * 2**30)
        speed = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{name:<28} {r['tokens_per_s']:>9.0f} {speed:>7.2f}x"
              f" {r['peak_rss'] / mib:>13.0f} {r['saved'] / mib:>10.1f} "
              f"{est.activations_per_microbatch / mib:>9.1f} {r['saved'] / base['saved']:>7.2f}x "
              f"{longest:>12}")  # fmt: skip


if __name__ == "__main__":
    main()
