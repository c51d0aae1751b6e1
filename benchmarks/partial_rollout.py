"""Partial rollout against whole rollouts, side by side in one run (each in its own process).

A GRPO run whose answers have a long tail of lengths: a freshly initialised model samples
nearly uniformly over a small vocabulary, so with ``--vocab 64`` an answer ends at each token
with probability 1/64 (lengths roughly geometric, mean 64, a few reaching the cap). A whole
rollout decodes its batch until its longest answer ends; with ``--partial-rollout-max-split N``
the long answers are cut into rounds shared with the next prompts. Printed: per rollout
(after the first, which fills the buffer), the rollout's seconds, the whole step's seconds,
the tokens sampled and the groups' mean age; the ratios of the means.

    python benchmarks/partial_rollout.py [--hidden 256] [--layers 2] [--response 256]
        [--prompts 16] [--group 8] [--split 4] [--steps 6] [--vocab 64]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np
import torch

from anyspeed.testing import run_distributed
from dpo import write
from grpo import tokenizer
from sft import base_cli, posttrain_run


def prompts(d: str, n: int, length: int, vocab: int) -> str:
    """``n`` random prompts of ``length`` tokens (no EOS), with a random reference answer."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, vocab - 2, length) for _ in range(n)]
    write(
        os.path.join(d, "rl"),
        {
            "input_ids": ids,
            "attention_mask": [np.ones(length)] * n,
            "labels": [rng.integers(0, vocab - 2, 4) for _ in ids],
        },
    )
    return os.path.join(d, "rl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--hidden", 256), ("--layers", 2), ("--prompt", 32),
                          ("--response", 256), ("--prompts", 16), ("--group", 8),
                          ("--split", 4), ("--steps", 6), ("--vocab", 64)):  # fmt: skip
        p.add_argument(flag, type=int, default=default)
    a = p.parse_args()
    seq, gbs = a.prompt + a.response, a.prompts * a.group
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}, fp32, hidden "
          f"{a.hidden}, {a.layers} layers, vocab {a.vocab}, {a.prompts} prompts x {a.group} "
          f"samples per rollout, answers up to {a.response} tokens, {a.steps} rollouts after "
          "the first")  # fmt: skip
    out = {}
    with tempfile.TemporaryDirectory() as d:
        tok, data = tokenizer(d, a.vocab), prompts(d, gbs * (a.steps + 3), a.prompt, a.vocab)
        for name, split in (("whole", 1), (f"split {a.split}", a.split)):
            metrics = os.path.join(d, f"{split}.jsonl")
            cli = base_cli(data, seq, a.steps + 1, gbs, a.group, a.hidden, a.layers)
            cli[cli.index("sft")] = "grpo"
            cli.remove("--is-instruction-dataset")
            cli[cli.index("--padded-vocab-size") + 1] = str(a.vocab)
            cli += ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tok,
                    "--n-samples-per-prompt", str(a.group), "--max-response-length",
                    str(a.response), "--verifier-function", "format", "--init-kl-coef", "0",
                    "--hidden-dropout", "0", "--attention-dropout", "0", "--metrics-file",
                    metrics, "--log-interval", "1", "--partial-rollout-max-split",
                    str(split)]  # fmt: skip
            run = run_distributed(posttrain_run, 1, argv=cli, cli=cli, timeout=3600)[0]
            rows = [json.loads(line) for line in open(metrics)][1:]
            steps = np.diff(run["times"])
            out[name] = (np.mean([r["timing/rollout"] for r in rows]), float(np.mean(steps)))
            tokens = [r.get("partial_rollout/generated_tokens", 0) for r in rows]
            rounds = [r.get("partial_rollout/rounds", 1) for r in rows]
            ages = [r.get("partial_rollout/age", 0.0) for r in rows]
            lengths = [r["response_length/mean"] for r in rows]
            print(f"  {name:9s} rollout {out[name][0]:6.2f} s | step {out[name][1]:6.2f} s | "
                  f"trained answers {np.mean(lengths):5.1f} tokens on average | "
                  f"sampled {np.mean(tokens) if split > 1 else gbs * np.mean(lengths):7.0f} "
                  f"tokens | {np.mean(rounds):.1f} rounds | age {np.mean(ages):.2f} "
                  "rollouts")  # fmt: skip
    whole, part = out["whole"], out[f"split {a.split}"]
    print(f"  split {a.split} / whole: rollout {whole[0] / part[0]:.2f}x faster, step "
          f"{whole[1] / part[1]:.2f}x faster")  # fmt: skip


if __name__ == "__main__":
    main()
