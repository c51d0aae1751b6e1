"""``anyspeed demo --distill``: on-policy distillation from a larger teacher, offline.

1-2. the demo corpus and tokenizer;
3-4. the ``--grpo`` demo's addition task, preprocessed: the student's SFT data (every answer
   in the verifier's form ``#### n`` and as the bare number), the prompts, 80 pairs held out;
5. the teacher: a 6-layer model of the demo's width, fine-tuned on answers in the verifier's
   form only;
6. the student: the 4-layer demo model after the ``--grpo`` demo's short SFT;
7. the held-out greedy accuracy of both (the verifier's strict rule);
8. ``anyspeed posttrain --stage distill`` on N processes (TP=N, SP): the student samples and
   the teacher's log-probabilities of its tokens are its only signal (no reward);
9. the student's held-out accuracy after, and its KL to the teacher before and after.

It fails (exit 1) unless the student's KL to the teacher fell. Extra flags go to the
distillation run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from anyspeed.argv import set_flag
from anyspeed.demo import grpo
from anyspeed.demo.common import FINETUNE, fresh_metrics, tokenizer_steps
from anyspeed.demo.instructions import write_jsonl
from anyspeed.demo.sft import preprocess

STEPS = 9
TEACHER_LAYERS = 6  # the student: the demo model's 4
DISTILL_TRAIN = [
    *("--lr", "1e-4", "--lr-decay-style", "constant", "--weight-decay", "0", *FINETUNE),
    *("--log-interval", "5", "--n-samples-per-prompt", "1", "--rollout-batch-size", "64"),
    *("--global-batch-size", "64", "--micro-batch-size", "32", "--max-response-length", "8"),
    *("--temperature", "1.0"),
]


def reverse_kl(metrics: str) -> list[float]:
    """Each step's ``distill/reverse_kl`` from a metrics file."""
    with open(metrics, encoding="utf-8") as f:
        return [r["distill/reverse_kl"] for r in map(json.loads, f) if "distill/reverse_kl" in r]


def teacher(
    args: argparse.Namespace, common: list[str], train: list[dict], tok_dir: str
) -> str | None:
    """Step 5: the teacher, fine-tuned on every training question answered in the verifier's
    form only; its checkpoint (None when a step failed)."""
    path = write_jsonl(
        os.path.join(args.workdir, "distill-teacher-sft.jsonl"), grpo.sft_records(train, (1, 0))
    )
    prefix = os.path.join(args.workdir, "distill-teacher-sft")
    if preprocess(path, prefix, tok_dir, "AlpacaStyleInstructionHandler"):
        return None
    what = f"{TEACHER_LAYERS} layers (the student's 4), fine-tuned on every training question"
    print(f"[5/{STEPS}] the teacher: {what} answered in the verifier's form only", flush=True)
    wider = set_flag(common, "--num-layers", str(TEACHER_LAYERS))
    return grpo.sft(args, wider, prefix, f"[5/{STEPS}]", "distill-teacher")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """The whole distillation demo; ``extra`` goes to ``anyspeed posttrain --stage distill``."""
    from anyspeed.commands.train import posttrain as posttrain_main

    t0 = time.perf_counter()
    rc, tok_dir = tokenizer_steps(args.workdir, args.corpus_mb or 1.0, STEPS)
    if rc:
        return rc
    rc, sft_prefix, rl_prefix, held = grpo.task_data(args, tok_dir, STEPS, "distillation")
    if rc:
        return rc
    common = grpo.common_flags(args, tok_dir)
    train, _ = grpo.task()
    teacher_save = teacher(args, common, train, tok_dir)
    student = teacher_save and grpo.sft(args, common, sft_prefix, f"[6/{STEPS}]", "distill")
    if not teacher_save or not student:
        return 1
    print(f"[7/{STEPS}] the teacher and the student on the held-out questions", flush=True)
    taught = grpo.heldout(args, teacher_save, tok_dir, held, f"[7/{STEPS}]")
    before = grpo.heldout(args, student, tok_dir, held, f"[7/{STEPS}]")
    save = os.path.join(args.workdir, "distill-checkpoints")
    metrics = fresh_metrics(os.path.join(args.workdir, "distill-metrics.jsonl"))
    steps = args.train_iters or 50
    cmd = [
        *("--stage", "distill", *common, "--load", student, "--finetune"),
        *("--teacher-model", teacher_save, *DISTILL_TRAIN, "--train-iters", str(steps)),
        *("--data-path", rl_prefix, "--save", save, "--save-interval", str(steps)),
        *("--metrics-file", metrics, *extra),
    ]
    print(f"[8/{STEPS}] anyspeed posttrain {' '.join(cmd)}", flush=True)
    if posttrain_main(cmd):
        return 1
    after = grpo.heldout(args, save, tok_dir, held, f"[9/{STEPS}]")
    kl = reverse_kl(metrics)
    if not kl or None in (taught, before, after):
        return 1
    last = sum(kl[-5:]) / len(kl[-5:])
    print(
        f"demo: the student's KL to the teacher {kl[0]:.2f} (step 1) -> {last:.2f} (the last "
        f"5 steps); held-out greedy accuracy {before:.2f} -> {after:.2f} (the teacher's "
        f"{taught:.2f})"
    )
    rc = 0 if last < kl[0] else 1
    print(f"demo finished in {time.perf_counter() - t0:.0f} s (exit {rc}); checkpoint in {save}")
    return rc
