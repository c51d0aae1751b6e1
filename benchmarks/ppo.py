"""PPO's memory against GRPO's, side by side in one run (each run in its own process): the
same model, prompts, samples and steps; PPO adds a critic (a second model of the policy's
architecture with its own gradients and optimizer state) and its values pass. Two measures as
in ``benchmarks/grpo.py``: the peak of tensor memory (from the allocator's events on the CPU,
the device allocator's peak elsewhere) and the process's RSS high-water mark.

    python benchmarks/ppo.py [--hidden 512] [--layers 4] [--prompt 96] [--response 32]
"""

from __future__ import annotations

import os
import tempfile

import torch

from anyspeed.testing import run_distributed
from grpo import make_sets, parser, tokenizer, traced_run
from sft import base_cli


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--beta", default="0.01", help="--init-kl-coef of both (0: no reference)")
    a = p.parse_args()
    seq = a.prompt + a.response
    from anyspeed.device import detect

    print(f"device {detect().name}, cpu capability: {torch.backends.cpu.get_cpu_capability()}, "
          f"fp32, hidden {a.hidden}, {a.layers} layers, prompt {a.prompt} + response "
          f"{a.response} tokens, 8 samples per prompt, micro-batch 8, 3 steps, "
          f"--init-kl-coef {a.beta}")  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tok = tokenizer(d)
        _, rl = make_sets(d, a, 64)
        cli = base_cli(rl, seq, 3, 16, 8, a.hidden, a.layers)
        cli[cli.index("sft")] = "grpo"
        cli.remove("--is-instruction-dataset")
        cli += ["--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type",
                "PretrainedFromHF", "--tokenizer-name-or-path", tok, "--n-samples-per-prompt",
                "8", "--max-response-length", str(a.response), "--verifier-function", "format",
                "--init-kl-coef", a.beta]  # fmt: skip
        if float(a.beta):  # a reference needs a checkpoint to start from: the initial weights
            init = os.path.join(d, "init")
            first = [*cli, "--save", init]
            first[first.index("--train-iters") + 1] = "0"
            first[first.index("--init-kl-coef") + 1] = "0"
            run_distributed(traced_run, 1, argv=first, cli=first, timeout=1800)
            cli += ["--load", init, "--finetune"]
        ppo = list(cli)
        ppo[ppo.index("grpo")] = "ppo"
        out = {}
        for name, argv in (("grpo", cli), ("ppo", ppo)):
            out[name] = run_distributed(traced_run, 1, argv=argv, cli=argv, timeout=1800)[0]
            print(f"  {name:5s} trainable {out[name]['trainable']:11,d} | tensor peak "
                  f"{out[name]['tensors'] / 2**20:8.1f} MiB | process peak "
                  f"{out[name]['peak'] / 2**20:8.1f} MiB")  # fmt: skip
        t = out["ppo"]["tensors"] / out["grpo"]["tensors"]
        r = out["ppo"]["peak"] / out["grpo"]["peak"]
        print(f"PPO / GRPO: tensor peak {t:.2f}x, process peak {r:.2f}x")


if __name__ == "__main__":
    main()
