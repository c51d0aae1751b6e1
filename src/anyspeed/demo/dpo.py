"""``anyspeed demo --dpo``: preference optimisation offline, from the SFT demo's model.

1-5. the SFT demo (``anyspeed.demo.sft``): tokenizer, instruction set, the model fine-tuned to
     answer its questions;
6. a preference set built offline from the same questions: the expected answer chosen, a
   corrupted one rejected (another function's answer to the same question), as alpaca pairwise
   jsonl, then ``anyspeed preprocess --handler-name AlpacaStylePairwiseHandler``;
7. ``anyspeed posttrain --stage dpo`` from the SFT checkpoint (the frozen reference) at TP=N;
8. ``anyspeed generate``: one answer of the DPO model.

It prints the reward accuracy and margin before (iteration 1, policy = reference: every reward
is 0) and after, and fails (exit 1) unless the accuracy reaches 0.9. Extra flags go to the DPO
run and win over the demo's.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from anyspeed.demo.common import DEMO_ARCH, FINETUNE, VOCAB, fresh_metrics, tp_layout
from anyspeed.demo.instructions import write_jsonl
from anyspeed.demo.sft import PROMPT_TYPE, generated_answers, preprocess, sft_model, show_answer

STEPS = 8
DPO_TRAIN = [
    "--dpo-beta",
    "0.1",
    "--lr",
    "1e-4",
    "--min-lr",
    "1e-5",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "5",
    "--weight-decay",
    "0",
    *FINETUNE,
    "--log-interval",
    "1",
    "--variable-seq-lengths",
]
TARGET = 0.9


def pairs(train: list[dict]) -> list[dict]:
    """Each question with its expected answer chosen and the next record's answer of the same
    kind (a wrong function's docstring or signature) rejected."""
    out = []
    for i, rec in enumerate(train):
        kind = rec["instruction"].split()[0]
        others = [r for r in train[i + 1 :] + train[:i] if r["instruction"].split()[0] == kind]
        wrong = next((r["output"] for r in others if r["output"] != rec["output"]), None)
        if wrong is None:
            continue
        out.append(
            {
                "instruction": rec["instruction"],
                "input": "",
                "chosen": rec["output"],
                "rejected": wrong,
            }
        )
    return out


def _preference_data(args: argparse.Namespace, tok_dir: str, train: list[dict]) -> tuple[int, str]:
    src = write_jsonl(os.path.join(args.workdir, "dpo-pairs.jsonl"), pairs(train))
    prefix = os.path.join(args.workdir, "dpo")
    rc = preprocess(src, prefix, tok_dir, "AlpacaStylePairwiseHandler")
    if rc == 0:
        print(
            f"[6/{STEPS}] preference set: {src} (the expected answer chosen, another "
            f"function's rejected) -> {prefix}_packed_{{chosen,rejected}}_{{input_ids,"
            "labels}_document",
            flush=True,
        )
    return rc, prefix


def _rewards(metrics: str) -> list[dict]:
    with open(metrics, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if "rewards/accuracies" in r]


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """The whole DPO demo; ``extra`` goes to ``anyspeed posttrain --stage dpo``."""
    from anyspeed.commands.train import posttrain as posttrain_main

    t0 = time.perf_counter()
    rc, sft_save, tok_dir, train = sft_model(args, [], STEPS)
    if rc:
        return rc
    rc, prefix = _preference_data(args, tok_dir, train)
    if rc:
        return rc
    save = os.path.join(args.workdir, "dpo-checkpoints")
    metrics = fresh_metrics(os.path.join(args.workdir, "dpo-metrics.jsonl"))
    n, iters = args.nproc_per_node, args.train_iters or 40
    samples = len(pairs(train))
    cmd = [
        "--nproc-per-node",
        str(n),
        "--stage",
        "dpo",
        "--is-pairwise-dataset",
        "--prompt-type",
        PROMPT_TYPE,
        *DEMO_ARCH,
        *tp_layout(n),
        "--padded-vocab-size",
        str(VOCAB),
        "--load",
        sft_save,
        "--finetune",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        str(samples - samples % 4),
        "--train-iters",
        str(iters),
        *DPO_TRAIN,
        "--data-path",
        prefix,
        "--save",
        save,
        "--save-interval",
        str(iters),
        "--metrics-file",
        metrics,
        *extra,
    ]
    print(f"[7/{STEPS}] anyspeed posttrain {' '.join(cmd)}", flush=True)
    rc = posttrain_main(cmd)
    if rc == 0:
        rows = _rewards(metrics)
        first, last = rows[0], rows[-1]
        print(
            f"demo: before, iteration {first['iteration']} (policy = reference): reward "
            f"margin {first['rewards/margins']:.3f}, accuracy "
            f"{first['rewards/accuracies']:.2f} (rewards ~0: ties decided by rounding)"
        )
        print(
            f"demo: after, iteration {last['iteration']}: reward margin "
            f"{last['rewards/margins']:.3f}, accuracy {last['rewards/accuracies']:.2f} (the "
            "chosen answer's implicit reward above the rejected one's)"
        )
        answers = generated_answers(args, save, tok_dir, train, f"[8/{STEPS}]")
        if answers:
            show_answer(train, answers)
        rc = 0 if answers and last["rewards/accuracies"] >= TARGET else 1
    print(f"demo finished in {time.perf_counter() - t0:.0f} s (exit {rc}); checkpoint in {save}")
    return rc
