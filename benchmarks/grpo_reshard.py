"""GRPO's rollout at TP 1 x DP (``--infer-tensor-parallel-size 1
--infer-pipeline-parallel-size 1 --infer-expert-parallel-size 1``) against the rollout at the
training layout, side by side in one run: seconds per rollout, the weights' move (reshard) per
rollout, sampled tokens per second, and peak memory (the rollout model is a whole copy of the
weights on every rank).

    python benchmarks/grpo_reshard.py [--hidden 512] [--layers 4] [--prompt 96]
        [--response 32] [--steps 4] [--layouts pp2 tp2 tp2-pp2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np
import torch

from anyspeed.testing import run_distributed
from grpo import make_sets, parser, tokenizer
from sft import base_cli, posttrain_run

INFER = ["--infer-tensor-parallel-size", "1", "--infer-pipeline-parallel-size", "1",
         "--infer-expert-parallel-size", "1"]  # fmt: skip
LAYOUTS = {  # name: (processes, flags)
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2-pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps = rollouts")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=["pp2", "tp2"])
    a = p.parse_args()
    seq = a.prompt + a.response
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}, hidden "
          f"{a.hidden}, {a.layers} layers, prompt {a.prompt} + response {a.response} tokens, "
          f"16 sequences per rollout, fp32")  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tok = tokenizer(d)
        _, rl = make_sets(d, argparse.Namespace(prompt=a.prompt, response=a.response), 64)
        base = base_cli(rl, seq, a.steps, 16, 8, a.hidden, a.layers)
        base[base.index("sft")] = "grpo"
        base.remove("--is-instruction-dataset")
        base += ["--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type",
                 "PretrainedFromHF", "--tokenizer-name-or-path", tok, "--n-samples-per-prompt",
                 "8", "--max-response-length", str(a.response), "--verifier-function", "format",
                 "--init-kl-coef", "0", "--log-interval", "1"]  # fmt: skip
        print(f"{'training':<10}{'rollout at':<14}{'rollout s':>10}{'reshard s':>10}"
              f"{'tokens/s':>10}{'peak MiB':>10}")  # fmt: skip
        for name in a.layouts:
            world, flags = LAYOUTS[name]
            for label, extra in ((name, []), (f"TP1 x DP{world}", INFER)):
                metrics = os.path.join(d, f"{name}-{len(extra)}.jsonl")
                cli = base + flags + extra + ["--metrics-file", metrics]
                out = run_distributed(posttrain_run, world, argv=cli, cli=cli, timeout=1800)
                rows = [json.loads(line) for line in open(metrics)][1:]  # after the first
                med = {k: float(np.median([r[k] for r in rows]))
                       for k in ("timing/rollout", "timing/reshard", "rollout_tps")}  # fmt: skip
                peak = max(o["peak"] for o in out) / 2**20
                print(f"{name:<10}{label:<14}{med['timing/rollout']:>10.3f}"
                      f"{med['timing/reshard']:>10.3f}{med['rollout_tps']:>10.0f}"
                      f"{peak:>10.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
