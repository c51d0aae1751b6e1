"""``anyspeed demo --grpo``: reinforcement learning with a verifiable reward, offline.

1-2. the demo corpus and tokenizer;
3. a verifiable task generated here: additions ``What is a + b?``; the verifier (GSM8K's strict
   rule) credits ``#### a+b`` only. The SFT data answers every question both as ``#### n`` (2
   times of 5) and as the bare number (3 of 5), so the SFT model often answers in the form the
   verifier does not credit: GRPO learns the form it wants (and sharper sums). Some pairs are
   held out from both SFT and GRPO;
4. ``anyspeed preprocess``: SFT data (a few answers shown) and GRPO prompts (the answer kept
   for the verifier, ``R1AlpacaStyleInstructionHandler``);
5. ``anyspeed posttrain --stage sft``: a short SFT of the demo model from scratch, to a
   partial greedy accuracy;
6. the held-out greedy accuracy before GRPO (``anyspeed generate``);
7. ``anyspeed posttrain --stage grpo`` on N processes (TP=N, SP) with the GSM8K rule reward;
8. the held-out accuracy after, and one sampled answer.

It fails (exit 1) unless the mean reward rose. Extra flags go to the GRPO run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time

from anyspeed.demo.common import (
    DEMO_ARCH,
    FINETUNE,
    VOCAB,
    fresh_metrics,
    tokenizer_steps,
    tp_layout,
)
from anyspeed.demo.instructions import write_jsonl
from anyspeed.demo.sft import PROMPT_TYPE, generated_answers, preprocess

STEPS = 8
TOP = 20  # operands 0..TOP-1
HELD_OUT = 80  # pairs never trained on (neither SFT nor GRPO)
# SFT answers per question in the credited form and as the bare number: (1, 1) left the SFT
# model 46% accurate and little room (+0.26 reward), (1, 2) 12% (below the 20-50% aimed at)
FORMS = (2, 3)
SFT_TRAIN = [
    "--lr",
    "2e-3",
    "--min-lr",
    "2e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "10",
    "--weight-decay",
    "0.01",
    *FINETUNE,
    "--log-interval",
    "20",
    "--variable-seq-lengths",
    "--micro-batch-size",
    "16",
    "--global-batch-size",
    "64",
]
GRPO_TRAIN = [
    "--lr",
    "1e-4",
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
    "128",
    "--micro-batch-size",
    "32",
    "--max-response-length",
    "8",
    "--rollout-batch-size",
    "32",
    "--temperature",
    "0.5",
    "--init-kl-coef",
    "0",
    "--verifier-function",
    "gsm8k",
]


def task(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records) of the addition task, alpaca style; the answer is
    ``#### a+b`` (what the verifier credits)."""
    pairs = [(a, b) for a in range(TOP) for b in range(TOP)]
    random.Random(seed).shuffle(pairs)

    def rec(a: int, b: int) -> dict:
        return {"instruction": f"What is {a} + {b}?", "input": "", "output": f"#### {a + b}"}

    return [rec(*p) for p in pairs[HELD_OUT:]], [rec(*p) for p in pairs[:HELD_OUT]]


def sft_records(train: list[dict], forms: tuple[int, int] = FORMS) -> list[dict]:
    """The SFT set: every question answered ``forms[0]`` times in the verifier's form and
    ``forms[1]`` times as the bare number, interleaved (the model learns both and picks one by
    chance)."""
    out = []
    for r in train:
        bare = dict(r, output=r["output"].removeprefix("#### "))
        n = max(forms)
        out += [x for i in range(n) for x, k in ((r, forms[0]), (bare, forms[1])) if i < k]
    return out


def accuracy(answers: list[str], records: list[dict]) -> float:
    """The share of answers whose ``#### n`` is the record's (the reward's strict rule)."""
    right = 0
    for a, r in zip(answers, records, strict=True):
        got = re.findall(r"#### (\-?[0-9\.\,]+)", a)
        right += bool(got) and got[-1].replace(",", "") == r["output"].split()[-1]
    return right / max(len(records), 1)


def task_data(
    args: argparse.Namespace, tok_dir: str, steps: int = STEPS, rl: str = "GRPO"
) -> tuple[int, str, str, list[dict]]:
    """Steps 3 and 4 (of ``steps``): the addition task, SFT data and prompts (for ``rl``),
    preprocessed; (exit code, SFT prefix, prompt prefix, held-out records)."""
    train, held = task()
    sft = write_jsonl(os.path.join(args.workdir, "grpo-sft.jsonl"), sft_records(train))
    rl = write_jsonl(os.path.join(args.workdir, "grpo-prompts.jsonl"), train)
    write_jsonl(os.path.join(args.workdir, "grpo-heldout.jsonl"), held)
    print(
        f"[3/{steps}] task: 'What is a + b?' -> '#### a+b' for a, b < {TOP}: {len(train)} "
        f"questions for SFT (each answered '#### n' and 'n') and {rl}, "
        f"{len(held)} held out from both",
        flush=True,
    )
    sft_prefix, rl_prefix = (os.path.join(args.workdir, n) for n in ("grpo-sft", "grpo-rl"))
    rc = preprocess(sft, sft_prefix, tok_dir, "AlpacaStyleInstructionHandler") or preprocess(
        rl, rl_prefix, tok_dir, "R1AlpacaStyleInstructionHandler"
    )
    if rc == 0:
        print(
            f"[4/{steps}] preprocess: {sft_prefix}_packed_* (SFT), {rl_prefix}_packed_* "
            "(prompts + answers for the verifier)",
            flush=True,
        )
    return rc, sft_prefix, rl_prefix, held


def heldout(
    args: argparse.Namespace, save: str, tok_dir: str, held: list[dict], step: str
) -> float | None:
    """The held-out greedy accuracy of checkpoint ``save`` (None when generation failed)."""
    answers = generated_answers(args, save, tok_dir, held, step)
    if not answers:
        return None
    acc = accuracy(answers, held)
    print(f"demo: held-out greedy accuracy {acc:.2f} ({round(acc * len(held))} of {len(held)})")
    return acc


def rewards(metrics: str) -> list[float]:
    """Each step's mean sampled reward from a metrics file."""
    with open(metrics, encoding="utf-8") as f:
        return [r["grpo/rewards/mean"] for r in map(json.loads, f) if "grpo/rewards/mean" in r]


def sft(
    args: argparse.Namespace,
    common: list[str],
    sft_prefix: str,
    step: str = f"[5/{STEPS}]",
    name: str = "grpo",
    default_iters: int = 300,  # fewer leave the model too weak to learn from (0.05 accurate)
) -> str | None:
    """The SFT model RL starts from (``<name>-sft-checkpoints``, ``--sft-iters`` iterations,
    else ``default_iters``); its checkpoint (None when training failed)."""
    from anyspeed.commands.train import posttrain as posttrain_main

    sft_save = os.path.join(args.workdir, f"{name}-sft-checkpoints")
    iters = args.sft_iters or default_iters
    cmd = [
        "--stage",
        "sft",
        "--is-instruction-dataset",
        *common,
        *SFT_TRAIN,
        "--train-iters",
        str(iters),
        "--data-path",
        sft_prefix,
        "--save",
        sft_save,
        "--save-interval",
        str(iters),
    ]
    print(f"{step} anyspeed posttrain {' '.join(cmd)}", flush=True)
    if posttrain_main(cmd):
        return None
    return sft_save


def common_flags(args: argparse.Namespace, tok_dir: str) -> list[str]:
    """The flags every run of the RL demos shares: processes, template, model, layout and
    tokenizer."""
    n = args.nproc_per_node
    return [
        "--nproc-per-node",
        str(n),
        "--prompt-type",
        PROMPT_TYPE,
        *DEMO_ARCH,
        *tp_layout(n),
        "--padded-vocab-size",
        str(VOCAB),
        "--tokenizer-type",
        "PretrainedFromHF",
        "--tokenizer-name-or-path",
        tok_dir,
    ]


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """The whole GRPO demo; ``extra`` goes to ``anyspeed posttrain --stage grpo``."""
    from anyspeed.commands.train import posttrain as posttrain_main

    t0 = time.perf_counter()
    # a 1 MiB tokenizer corpus: with 6 the demo's SFT model learnt less (+0.13 reward, not +0.27)
    rc, tok_dir = tokenizer_steps(args.workdir, args.corpus_mb or 1.0, STEPS)
    if rc:
        return rc
    rc, sft_prefix, rl_prefix, held = task_data(args, tok_dir)
    if rc:
        return rc
    common = common_flags(args, tok_dir)
    sft_save = sft(args, common, sft_prefix)
    if sft_save is None:
        return 1
    before = heldout(args, sft_save, tok_dir, held, f"[6/{STEPS}]")
    save = os.path.join(args.workdir, "grpo-checkpoints")
    metrics = fresh_metrics(os.path.join(args.workdir, "grpo-metrics.jsonl"))
    steps = args.train_iters or 50
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
    print(f"[7/{STEPS}] anyspeed posttrain {' '.join(cmd)}", flush=True)
    if posttrain_main(cmd):
        return 1
    after = heldout(args, save, tok_dir, held, f"[8/{STEPS}]")
    r = rewards(metrics)
    if not r or before is None or after is None:
        return 1
    last = sum(r[-5:]) / len(r[-5:])
    print(
        f"demo: mean reward {r[0]:.2f} (step 1, before any update) -> {last:.2f} (the last 5 "
        f"steps); held-out greedy accuracy {before:.2f} -> {after:.2f}"
    )
    sample = generated_answers(args, save, tok_dir, held[:1], f"[8/{STEPS}]", sample=True)
    if sample:
        print(f"demo: a sampled answer: {held[0]['instruction']} -> {sample[0]!r}")
    rc = 0 if last > r[0] else 1
    print(f"demo finished in {time.perf_counter() - t0:.0f} s (exit {rc}); checkpoint in {save}")
    return rc
