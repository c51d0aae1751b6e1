"""``anyspeed demo --tools``: multi-turn RL with a tool, offline.

1-2. the demo corpus and tokenizer (its chat template renders tool calls and tool turns);
3. a task the tiny model cannot do alone: ``What is a * b?`` for a 3-digit ``a`` and a 2-digit
   ``b``. The SFT conversations answer each question both with the ``calculator`` tool (a
   hermes call of ``a * b``, the tool's answer, then that number alone: the same tokens, easy
   to copy) and without it (a rough guess in thousands), so the SFT model calls the tool only
   part of the time;
4. ``anyspeed preprocess``: the conversations (OpenAI layout, tool turns unlabelled) and the
   prompts (the product kept for the verifier);
5. ``anyspeed posttrain --stage sft``: a short SFT from scratch;
6. ``anyspeed posttrain --stage grpo --tools calculator``: the model's answers run the tool,
   its answer comes back as a tool turn, sampling goes on; GSM8K's flexible rule credits the
   product as the last number of the last turn. Calling the tool is what earns the reward: it rises.

It prints the reward (= accuracy: 1 for the exact product) and the tool calls per sample of the
first and last steps, and fails (exit 1) unless the reward rose. Extra flags go to the GRPO run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from anyspeed.demo.common import DEMO_ARCH, FINETUNE, VOCAB, fresh_metrics, tokenizer_steps
from anyspeed.demo.grpo import sft
from anyspeed.demo.instructions import write_jsonl
from anyspeed.demo.sft import preprocess

STEPS = 6
QUESTIONS = 1200
TOOL_SHARE = (1, 1)  # SFT answers per question: with the tool, and a guess without it
ARCH = [
    *DEMO_ARCH[: DEMO_ARCH.index("--seq-length")],
    "--seq-length",
    "192",
    "--max-position-embeddings",
    "192",
]
GRPO_TRAIN = [
    "--lr",
    "3e-5",
    "--lr-decay-style",
    "constant",
    "--weight-decay",
    "0",
    *FINETUNE,
    "--log-interval",
    "1",
    "--n-samples-per-prompt",
    "8",
    "--global-batch-size",
    "64",
    "--micro-batch-size",
    "16",
    "--max-response-length",
    "96",
    "--rollout-batch-size",
    "8",
    "--temperature",
    "0.5",
    "--init-kl-coef",
    "0",
    "--verifier-function",
    "gsm8k_flexible",
    "--tools",
    "calculator",
    "--max-tool-calls",
    "1",
]


def call(a: int, b: int) -> dict:
    args = {"expression": f"{a} * {b}"}
    return {"type": "function", "function": {"name": "calculator", "arguments": args}}


def records(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(SFT conversations, GRPO prompts) of the multiplication task."""
    rng = random.Random(seed)
    sft, prompts = [], []
    for _ in range(QUESTIONS):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        # the expression quoted as the call writes it: the digits are the same tokens to copy
        q = {"role": "user", "content": f'What is "{a} * {b}"?'}
        tool = [
            q,
            {"role": "assistant", "content": "", "tool_calls": [call(a, b)]},
            {"role": "tool", "name": "calculator", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ]
        rough = round(a * b, -3) + rng.choice([-1, 1]) * rng.randint(0, 2) * 1000
        rough += 1000 if rough == a * b else 0  # a guess is never the product
        guess = [q, {"role": "assistant", "content": f"Roughly {rough}."}]
        sft += [{"messages": tool}] * TOOL_SHARE[0] + [{"messages": guess}] * TOOL_SHARE[1]
        prompts.append({"instruction": q["content"], "input": "", "output": f"#### {a * b}"})
    rng.shuffle(sft)
    return sft, prompts


def common_flags(args: argparse.Namespace, tok_dir: str) -> list[str]:
    return [
        "--nproc-per-node",
        str(args.nproc_per_node),
        *ARCH,
        "--padded-vocab-size",
        str(VOCAB),
        "--tokenizer-type",
        "PretrainedFromHF",
        "--tokenizer-name-or-path",
        tok_dir,
    ]


def stats(metrics: str) -> list[dict]:
    with open(metrics, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if "grpo/rewards/mean" in r]


def task_data(args: argparse.Namespace, tok_dir: str) -> tuple[int, str, str]:
    """Steps 3 and 4: the conversations and prompts, preprocessed with the tokenizer's chat
    template; (exit code, SFT prefix, prompt prefix)."""
    sft, prompts = records()
    sft_src = write_jsonl(os.path.join(args.workdir, "tools-sft.jsonl"), sft)
    rl_src = write_jsonl(os.path.join(args.workdir, "tools-prompts.jsonl"), prompts)
    print(
        f"[3/{STEPS}] task: 'What is a * b?' (a < 1000, b < 100), {QUESTIONS} questions, each "
        "answered with the calculator and with a guess",
        flush=True,
    )
    sft_prefix, rl_prefix = (os.path.join(args.workdir, n) for n in ("tools-sft", "tools-rl"))
    rc = preprocess(sft_src, sft_prefix, tok_dir, "OpenAIStyleInstructionHandler", None) or (
        preprocess(rl_src, rl_prefix, tok_dir, "R1AlpacaStyleInstructionHandler", None)
    )
    if rc == 0:
        print(f"[4/{STEPS}] preprocess: {sft_prefix}_packed_*, {rl_prefix}_packed_*", flush=True)
    return rc, sft_prefix, rl_prefix


def report(metrics: str) -> int:
    """The reward and the calls per sample of the first and last 5 steps; 0 when the reward
    rose."""
    rows = stats(metrics)
    if not rows:
        return 1
    first, last = rows[:5], rows[-5:]

    def mean(rs: list[dict], key: str) -> float:
        return sum(r[key] for r in rs) / len(rs)

    before, after = mean(first, "grpo/rewards/mean"), mean(last, "grpo/rewards/mean")
    calls = (mean(first, "tools/calls_per_sample"), mean(last, "tools/calls_per_sample"))
    print(
        f"demo: reward (= accuracy) {before:.2f} (first 5 steps) -> {after:.2f} (last 5); "
        f"calculator calls per sample {calls[0]:.2f} -> {calls[1]:.2f}"
    )
    return 0 if after > before else 1


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """The whole tools demo; ``extra`` goes to ``anyspeed posttrain --stage grpo``."""
    from anyspeed.commands.train import posttrain as posttrain_main

    t0 = time.perf_counter()
    rc, tok_dir = tokenizer_steps(args.workdir, args.corpus_mb or 1.0, STEPS)
    if rc:
        return rc
    rc, sft_prefix, rl_prefix = task_data(args, tok_dir)
    if rc:
        return rc
    common = common_flags(args, tok_dir)
    sft_save = sft(args, common, sft_prefix, f"[5/{STEPS}]", name="tools", default_iters=400)
    if sft_save is None:
        return 1
    save = os.path.join(args.workdir, "tools-checkpoints")
    metrics = fresh_metrics(os.path.join(args.workdir, "tools-metrics.jsonl"))
    # 80 steps: on an AVX2 CPU the reward rose 0.42 -> 0.84 within 50; on a Sapphire Rapids
    # one (other float sums, another SFT model) it was 0.50 at 50 and 0.68 at 80
    steps = args.train_iters or 80
    cmd = [
        "--stage",
        "grpo",
        *common,
        "--load",
        sft_save,
        "--finetune",
        *GRPO_TRAIN,
        "--train-iters",
        str(steps),
        "--data-path",
        rl_prefix,
        "--save",
        save,
        "--save-interval",
        str(steps),
        "--metrics-file",
        metrics,
        *extra,
    ]
    print(f"[6/{STEPS}] anyspeed posttrain {' '.join(cmd)}", flush=True)
    if posttrain_main(cmd):
        return 1
    rc = report(metrics)
    print(f"demo finished in {time.perf_counter() - t0:.0f} s (exit {rc}); checkpoint in {save}")
    return rc
