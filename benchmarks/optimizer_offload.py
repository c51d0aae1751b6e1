"""The GPU check of ``--swap-optimizer`` (optimizer states and fp32 main parameters in host memory
between steps): bit-equal losses and grad norms with and without it over 5 steps, and device
memory after a step lower by the bytes it moved to the host.

Run on a machine with CUDA (or another torch accelerator); one process per run, bf16, Adam:

    python benchmarks/optimizer_offload.py [--layers 8] [--hidden 1024] [--steps 5]

Exit status 1 when a check fails. On the CPU the flag is a no-op by design (the states already
live in host memory), so the script only shows equal losses there.
"""

from __future__ import annotations

import argparse
import sys

from anyspeed.testing import run_distributed


def offload_run(model: dict, steps: int) -> dict:
    """One rank: ``steps`` bf16 steps; losses, grad norms, device bytes allocated after each
    step and the bytes the offload keeps on the host."""
    import torch

    from anyspeed.layout import Layout
    from anyspeed.models import ModelConfig
    from anyspeed.stages.pretrain.task import PretrainTask
    from anyspeed.training.config import TrainConfig
    from anyspeed.training.step import Trainer
    from anyspeed.training.synthetic import train_step

    cfg = TrainConfig(seq_length=1024, micro_batch_size=2, global_batch_size=2, bf16=True)
    trainer = Trainer(ModelConfig(**model), Layout(), cfg, PretrainTask())
    cuda = torch.cuda.is_available()
    out, allocated = [], []
    for _ in range(steps):
        out.append(train_step(trainer))
        allocated.append(torch.cuda.memory_allocated() if cuda else 0)
    offload = getattr(trainer.optimizer, "offload", None)
    return {"loss": [o["loss"] for o in out], "grad_norm": [o["grad_norm"] for o in out],
            "allocated": allocated, "host_bytes": offload.offloaded_bytes if offload else 0,
            "params": sum(p.numel() for m in trainer.model for p in m.parameters())}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    model = dict(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.hidden // 64,
                 ffn_hidden_size=a.hidden * 11 // 4, vocab_size=32000)  # fmt: skip
    runs = {
        flag: run_distributed(offload_run, 1, timeout=1800, argv=flags, model=model, steps=a.steps)[
            0
        ]  # fmt: skip
        for flag, flags in (("none", []), ("--swap-optimizer", ["--swap-optimizer"]))
    }
    none, swap = runs["none"], runs["--swap-optimizer"]
    mib = 2**20
    print(f"{none['params'] / 1e6:.0f}M parameters, bf16 Adam, {a.steps} steps")
    for name, r in runs.items():
        print(
            f"  {name:<18} loss {r['loss'][-1]:.6f}  device MiB after the last step "
            f"{r['allocated'][-1] / mib:9.1f}  on the host {r['host_bytes'] / mib:9.1f}"
        )
    failures = []
    if swap["loss"] != none["loss"] or swap["grad_norm"] != none["grad_norm"]:
        failures.append(f"losses differ: {none['loss']} vs {swap['loss']}")
    if none["allocated"][-1]:  # an accelerator: the states and main copies left the device
        dropped = none["allocated"][-1] - swap["allocated"][-1]
        print(
            f"  device memory dropped by {dropped / mib:.1f} MiB; expected about "
            f"{swap['host_bytes'] / mib:.1f} MiB (12 bytes per parameter)"
        )
        if swap["host_bytes"] < 11 * none["params"] or dropped < 0.9 * swap["host_bytes"]:
            failures.append("device memory did not drop by the offloaded bytes")
    for line in failures:
        print("FAILED:", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
