"""GRPO memory and rollout speed, side by side in one run (each run in its own process).

Peak memory of GRPO-LoRA against SFT-LoRA of the same model (r 16 on linear_qkv/proj/fc1/fc2)
on sequences of the same length and micro-batch: GRPO adds the rollout (KV cache), the
old-policy pass and, with a KL term, the reference pass (the base with adapters off: no second
copy). Two measures: the peak of tensor memory (on the CPU from the allocator's events, see
``anyspeed.features.memory.trace``; on an accelerator its allocator's peak), which is the
same in every run, and the process's peak (the RSS high-water mark on the CPU, which adds the
Python and library footprint and moves by tens of MiB between runs). Also GRPO's own rollout
throughput (sampled tokens per second) from its metrics.

    python benchmarks/grpo.py [--hidden 512] [--layers 4] [--prompt 96] [--response 32] [--beta 0]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np
import torch

from anyspeed.testing import run_distributed
from dpo import LORA, write
from sft import VOCAB, base_cli, posttrain_run


def traced_run(cli: list[str]) -> dict:
    """:func:`posttrain_run` with the peak of tensor memory: on the CPU from the allocator's
    events over the whole run, elsewhere the device allocator's own peak."""
    from anyspeed.device import detect
    from anyspeed.features.memory.trace import AllocationTrace

    if not detect().is_cpu:
        out = posttrain_run(cli)
        return dict(out, tensors=out["peak"])
    with AllocationTrace() as trace:
        out = posttrain_run(cli)
    return dict(out, tensors=trace.peak())


def tokenizer(d: str, size: int = VOCAB) -> str:
    """A word-level tokenizer of ``size`` tokens ``t0 ..``, the last one the EOS, saved for
    transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(size - 2)} | {"<unk>": size - 2, "<eos>": size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                   pad_token="<eos>")  # fmt: skip
    path = os.path.join(d, "tok")
    fast.save_pretrained(path)
    return path


def make_sets(d: str, a: argparse.Namespace, n: int) -> tuple[str, str]:
    """SFT samples of prompt + response tokens (prompt labelled -100), and the same prompts as
    GRPO prompt data (with a random answer for the verifier)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB - 2, a.prompt) for _ in range(n)]
    sft_rows = []
    for p in prompts:
        ids = np.concatenate([p, rng.integers(0, VOCAB - 2, a.response)])
        sft_rows.append((ids, np.concatenate([np.full(a.prompt, -100), ids[a.prompt :]])))
    write(
        os.path.join(d, "sft"),
        {
            "input_ids": [r[0] for r in sft_rows],
            "labels": [r[1] for r in sft_rows],
            "attention_mask": [np.ones(len(r[0])) for r in sft_rows],
        },
    )
    write(
        os.path.join(d, "rl"),
        {
            "input_ids": prompts,
            "attention_mask": [np.ones(a.prompt)] * n,
            "labels": [rng.integers(0, VOCAB - 2, 4) for _ in prompts],
        },
    )
    return os.path.join(d, "sft"), os.path.join(d, "rl")


def parser(doc: str) -> argparse.ArgumentParser:
    """The model and sequence flags of the GRPO benchmarks."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    for flag, default in (("--hidden", 512), ("--layers", 4), ("--prompt", 96), ("--response", 32)):
        p.add_argument(flag, type=int, default=default)
    return p


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--beta", default="0.01", help="--init-kl-coef of the GRPO run (0: no reference)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of each, medians compared")
    p.add_argument("--bf16", action="store_true", help="both runs in bf16 (default fp32)")
    a = p.parse_args()
    seq = a.prompt + a.response
    from anyspeed.device import detect

    print(f"device {detect().name}, cpu capability: {torch.backends.cpu.get_cpu_capability()}, "
          f"{'bf16' if a.bf16 else 'fp32'}, hidden {a.hidden}, "
          f"{a.layers} layers, prompt {a.prompt} + response {a.response} tokens, micro-batch 8, "
          "3 steps")  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tok = tokenizer(d)
        sft, rl = make_sets(d, a, 64)
        no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0"]
        no_dropout += ["--bf16"] if a.bf16 else []
        sft_cli = base_cli(sft, seq, 3, 16, 8, a.hidden, a.layers) + LORA + no_dropout
        grpo_cli = base_cli(rl, seq, 3, 16, 8, a.hidden, a.layers) + no_dropout
        grpo_cli[grpo_cli.index("sft")] = "grpo"
        grpo_cli.remove("--is-instruction-dataset")
        metrics = os.path.join(d, "m.jsonl")
        grpo_cli += [*LORA, "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
                     tok, "--n-samples-per-prompt", "8", "--max-response-length",
                     str(a.response), "--verifier-function", "format", "--init-kl-coef", a.beta,
                     "--metrics-file", metrics, "--log-interval", "1"]  # fmt: skip
        peaks: dict[str, list[int]] = {"sft-lora": [], "grpo-lora": []}
        tensors: dict[str, int] = {}
        for i in range(a.repeats + 1):  # RSS high-water marks vary by tens of MiB between runs
            for name, cli in (("sft-lora", sft_cli), ("grpo-lora", grpo_cli)):
                # The first run of each traces tensor memory (the profiler's own memory would
                # inflate the process peak: it is left out of the medians).
                fn = traced_run if i == 0 else posttrain_run
                out = run_distributed(fn, 1, argv=cli, cli=cli, timeout=1800)[0]
                if i == 0:
                    tensors[name] = out["tensors"]
                    print(f"  {name:9s} trainable {out['trainable']:10,d} | tensor peak "
                          f"{out['tensors'] / 2**20:8.1f} MiB")  # fmt: skip
                else:
                    peaks[name].append(out["peak"])
                    print(f"  {name:9s} process peak {out['peak'] / 2**20:8.1f} MiB")
        rows = [json.loads(line) for line in open(metrics)][-3:]  # the last GRPO run's
        tps = [r["rollout_tps"] for r in rows[1:]]
        sft, grpo = (float(np.median(peaks[k])) for k in ("sft-lora", "grpo-lora"))
        print(f"  grpo-lora / sft-lora tensor peak: "
              f"{tensors['grpo-lora'] / tensors['sft-lora']:.3f}x")  # fmt: skip
        print(f"  grpo-lora / sft-lora process peak (medians of {a.repeats} runs each): "
              f"{grpo / sft:.3f}x")  # fmt: skip
        print(
            f"  rollout: {np.mean(tps):,.0f} sampled tokens/s (batch {16}, after the first), "
            f"rollout {np.mean([r['timing/rollout'] for r in rows[1:]]):.2f} s, old log-probs "
            f"{np.mean([r['timing/old_log_p'] for r in rows[1:]]):.2f} s, reference "
            f"{np.mean([r['timing/reference_model'] for r in rows[1:]]):.2f} s per rollout"
        )
        worst = max(r["rollout/logp_mismatch_max"] for r in rows)
        print(f"  rollout/training log-prob mismatch: mean "
              f"{max(r['rollout/logp_mismatch'] for r in rows):.1e}, max {worst:.1e} "
              "(the worst step)")  # fmt: skip


if __name__ == "__main__":
    main()
