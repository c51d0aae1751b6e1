"""GRPO padded against ``--use-remove-padding`` and ``--use-dynamic-bsz``, side by side in one
run (each run in its own process, the same prompts, seeds and sampled tokens), LoRA r 16 (the
reference: its base with the adapters off).

Prompts of random lengths (``--min-prompt`` to ``--prompt`` tokens) make the padding a
padded run computes: each micro-batch is padded to the rollout's longest sequence. The
training side of a step (old and reference log-probs, the update) is the step's time less its
rollout (sampling, which packing does not touch); the ratios compare medians over the steps
after the first of ``--repeats`` runs each, and the tensor peak of each (first run).

    python benchmarks/rl_packing.py [--hidden 512] [--layers 4] [--prompt 224] [--min-prompt 16]
        [--response 32] [--repeats 2]
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import torch

from anyspeed.testing import run_distributed
from dpo import LORA
from grpo import parser, tokenizer, traced_run
from sft import VOCAB, base_cli, posttrain_run

RUNS = {
    "padded": [],
    "remove-padding": ["--use-remove-padding"],
    # the budget: a padded micro-batch's tokens (8 x --seq-length), so no micro-batch is larger
    "dynamic-bsz": ["--use-remove-padding", "--use-dynamic-bsz", "--max-packing-token-size"],
}


def prompts(d: str, a, n: int) -> str:
    """GRPO prompt data: ``n`` prompts of random lengths (with a random answer each)."""
    from dpo import write

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, VOCAB - 2, rng.integers(a.min_prompt, a.prompt + 1)) for _ in range(n)]
    write(
        os.path.join(d, "rl"),
        {
            "input_ids": rows,
            "attention_mask": [np.ones(len(r)) for r in rows],
            "labels": [rng.integers(0, VOCAB - 2, 4) for _ in rows],
        },
    )
    return os.path.join(d, "rl")


def grpo_cli(prefix: str, tok: str, a, metrics: str) -> list[str]:
    seq = a.prompt + a.response
    cli = base_cli(prefix, seq, a.steps, 64, 8, a.hidden, a.layers)
    cli[cli.index("sft")] = "grpo"
    cli.remove("--is-instruction-dataset")
    return cli + [*LORA, "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type",
                  "PretrainedFromHF", "--tokenizer-name-or-path", tok, "--n-samples-per-prompt",
                  "8", "--max-response-length", str(a.response), "--max-prompt-length",
                  str(a.prompt), "--verifier-function", "format", "--init-kl-coef", "0.01",
                  "--metrics-file", metrics, "--log-interval", "1"]  # fmt: skip


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(prompt=224)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    from anyspeed.device import detect

    print(f"device {detect().name}, cpu capability: {torch.backends.cpu.get_cpu_capability()}, "
          f"fp32, hidden {a.hidden}, {a.layers} layers, prompts of {a.min_prompt}-{a.prompt} + "
          f"{a.response} answer tokens, 64 sequences a step (8 prompts x 8), micro-batch 8, "
          f"{a.steps} steps")  # fmt: skip
    train: dict[str, list[float]] = {k: [] for k in RUNS}
    tensors: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as d:
        tok, rl = tokenizer(d), prompts(d, a, 64)
        for i in range(a.repeats):
            for name, extra in RUNS.items():
                metrics = os.path.join(d, f"{name}-{i}.jsonl")
                cli = grpo_cli(rl, tok, a, metrics) + extra
                if extra and extra[-1] == "--max-packing-token-size":
                    cli.append(str(8 * (a.prompt + a.response)))
                fn = traced_run if i == 0 else posttrain_run
                out = run_distributed(fn, 1, argv=cli, cli=cli, timeout=1800)[0]
                rows = [json.loads(line) for line in open(metrics)]
                steps = np.diff(out["times"])  # the steps after the first
                rollout = [r["timing/rollout"] for r in rows[1:]]
                train[name] += list(steps - np.asarray(rollout[: len(steps)]))
                if i == 0:
                    tensors[name] = out["tensors"]
                print(f"  {name:15s} run {i}: step {np.median(steps):.2f} s, of which rollout "
                      f"{np.median(rollout):.2f} s")  # fmt: skip
    base = float(np.median(train["padded"]))
    for name in RUNS:
        t = float(np.median(train[name]))
        peak = tensors[name] / 2**20
        print(f"  {name:15s} training side {t:.2f} s/step ({base / t:.2f}x padded) | "
              f"tensor peak {peak:.0f} MiB ({tensors[name] / tensors['padded']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
