"""``--reuse-fp32-param``: peak RSS of bf16 training with and without it, side by side.

For each model (the 55M Qwen2.5-shaped benchmark model and Qwen2.5-0.5B) and each optimizer
(Megatron's plain bf16 optimizer; the distributed optimizer at DP=2) it trains a few bf16 steps
(sequence 128, micro-batch 1, AdamW) in fresh processes, once on the regular fp32-master path and
once with ``--reuse-fp32-param``, and prints the peak RSS per rank over the training steps
after the first (the first allocates Adam's states; the high-water mark is reset there, so
building the model does not count), the saving, the saving predicted by 2 bytes x parameters of
the rank (/DP with the distributed optimizer), the saving in RSS held after the steps, and
whether the losses are identical (bit for bit).

    python benchmarks/reuse_fp32.py [--models 55m 0.5b] [--steps 3]
"""

from __future__ import annotations

import argparse
import ctypes
import gc

from anyspeed.testing import run_distributed

MODELS = {
    "55m": dict(
        family="qwen2",
        num_layers=8,
        hidden_size=512,
        ffn_hidden_size=1408,
        num_attention_heads=8,
        num_query_groups=2,
        vocab_size=32000,
        add_qkv_bias=True,
    ),  # fmt: skip
    "0.5b": "qwen2.5-0.5b",
}


def rank(model: str, steps: int, distopt: bool) -> dict:
    """Train ``steps`` bf16 steps; peak RSS of this process and the losses."""
    from anyspeed import quiet
    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig, get_preset
    from anyspeed.stages.pretrain.task import PretrainTask
    from anyspeed.training import synthetic
    from anyspeed.training.config import TrainConfig
    from anyspeed.training.step import Trainer

    spec = MODELS[model]
    config = get_preset(spec) if isinstance(spec, str) else ModelConfig(**spec)
    cfg = TrainConfig(bf16=True, seq_length=128, micro_batch_size=1,
                      global_batch_size=2 if distopt else 1, lr=1e-4)  # fmt: skip
    quiet.install()
    _fixed_mmap_threshold()
    t = Trainer(config, Layout(distributed_optimizer=distopt), cfg, PretrainTask())
    losses = [synthetic.train_step(t)["loss"]]  # the first step allocates the Adam states
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS: building the model (fp32 first) is not training
    losses += [synthetic.train_step(t)["loss"] for _ in range(steps - 1)]
    params = sum(p.numel() for p in t.model[0].parameters())
    return {"peak_gib": _status_kib("VmHWM") / 2**20, "now_gib": _status_kib("VmRSS") / 2**20,
            "losses": losses, "params": params}  # fmt: skip


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _fixed_mmap_threshold() -> None:
    """Big blocks come from mmap and go back to the OS when freed (glibc raises the threshold
    dynamically otherwise, and freed heap memory can stay resident): the same for both runs."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from anyspeed import quiet

    quiet.install()
    print(f"{'model':<6} {'optimizer':<14} {'params':>8} {'peak: regular':>13} {'reuse':>9} "
          f"{'saved':>8} {'2B x params/DP':>14} {'held: saved':>11} "
          f"{'losses equal':>12}")  # fmt: skip
    for model in args.models:
        for distopt in (False, True):
            world = 2 if distopt else 1
            runs = []
            for argv in (["--bf16"], ["--bf16", "--reuse-fp32-param"]):
                runs.append(run_distributed(rank, world, model=model, steps=args.steps,
                                            distopt=distopt, argv=argv, timeout=3600))  # fmt: skip
            ref, got = (max(r["peak_gib"] for r in ranks) for ranks in runs)
            held = max(r["now_gib"] for r in runs[0]) - max(r["now_gib"] for r in runs[1])
            params = runs[0][0]["params"]
            expect = 2 * params / world / 2**30
            same = runs[0][0]["losses"] == runs[1][0]["losses"]
            name = "dist-opt DP=2" if distopt else "plain"
            print(f"{model:<6} {name:<14} {params / 1e6:>7.1f}M {ref:>11.3f}Gi {got:>7.3f}Gi "
                  f"{ref - got:>6.3f}Gi {expect:>12.3f}Gi {held:>9.3f}Gi {str(same):>12}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
