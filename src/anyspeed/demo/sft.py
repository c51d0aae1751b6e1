"""``anyspeed demo --sft``: supervised fine-tuning offline, then the model answers a prompt.

1-2. the pretrain demo's corpus and byte-level BPE tokenizer (it has the ChatML tokens);
3. an instruction set from the standard library's docstrings and signatures, as alpaca jsonl,
   and ``--sft-samples`` of its records spread over it to train on;
4. ``anyspeed preprocess --handler-name AlpacaStyleInstructionHandler --prompt-type chatml``;
5. ``anyspeed posttrain --stage sft``: the demo model from scratch on N processes (TP=N, sequence
   parallel), full-batch, until it reproduces the responses (a deliberate overfit);
6. ``anyspeed generate``: greedy answers to the trained prompts; one is shown with its
   expected response.

It fails (exit 1) unless the response loss has clearly fallen. Extra flags go to
``anyspeed posttrain`` and win over the demo's (``--load DIR --finetune`` starts from the
pretrain demo's checkpoint, which was trained with the same tokenizer).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

from anyspeed.demo.common import (
    DEMO_ARCH,
    FINETUNE,
    VOCAB,
    fresh_metrics,
    loss_fell,
    stdlib_files,
    tokenizer_steps,
    tp_layout,
)
from anyspeed.demo.instructions import build_instructions, spread, write_jsonl

PROMPT_TYPE = "chatml"  # the tokenizer's <|im_start|>/<|im_end|>, no system prompt to learn
SET_SIZE = 400
MAX_NEW_TOKENS = 64
# Settings that overfit a few dozen samples from scratch: full batch, no weight decay.
SFT_TRAIN = [
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "10",
    "--weight-decay",
    "0",
    *FINETUNE,
    "--log-interval",
    "10",
    "--variable-seq-lengths",
]


def _data(args: argparse.Namespace, tok_dir: str, steps: int) -> tuple[int, str, list[dict]]:
    """Steps 3 and 4: the instruction set, the records trained on, preprocessed.
    Returns (exit code, dataset prefix, the records trained on)."""
    records = build_instructions(stdlib_files(), SET_SIZE)
    full = write_jsonl(os.path.join(args.workdir, "instructions.jsonl"), records)
    train = spread(records, args.sft_samples)
    src = write_jsonl(os.path.join(args.workdir, "sft-train.jsonl"), train)
    print(
        f"[3/{steps}] instruction set: {len(records)} questions on standard-library functions -> "
        f"{full}; {len(train)} of them to train on -> {src}"
    )
    prefix = os.path.join(args.workdir, "sft")
    rc = preprocess(src, prefix, tok_dir, "AlpacaStyleInstructionHandler")
    if rc == 0:
        print(
            f"[4/{steps}] preprocess: {prefix}_packed_{{input_ids,attention_mask,labels}}"
            f"_document (--prompt-type {PROMPT_TYPE}; prompt tokens carry no loss)"
        )
    return rc, prefix, train


def preprocess(
    src: str,
    prefix: str,
    tok_dir: str,
    handler: str,
    prompt_type: str | None = PROMPT_TYPE,
    *flags: str,
) -> int:
    """``anyspeed preprocess`` of a demo jsonl with the demo's template (``prompt_type`` None:
    the tokenizer's own chat template, which renders tools, or no template for step-labelled
    text) and the handler's own ``flags``; its exit code."""
    from anyspeed.commands.preprocess import main as data_main

    template = ["--prompt-type", prompt_type] if prompt_type else []
    return data_main(
        [
            "preprocess",
            "--input",
            src,
            "--output-prefix",
            prefix,
            "--tokenizer-name-or-path",
            tok_dir,
            "--handler-name",
            handler,
            *template,
            *flags,
            "--workers",
            "1",
            "--overwrite",
            "--quiet",
        ]
    )


def generated_answers(
    args: argparse.Namespace,
    save: str,
    tok_dir: str,
    train: list[dict],
    step: str = "[6/6]",
    sample: bool = False,
) -> list[str]:
    """Step 6: ``anyspeed generate`` (greedy, TP=N like training) on every trained prompt, as
    a user would run it; the answers in order, or [] when it failed (it has said why)."""
    from anyspeed.launch import single_process_env

    prompts = os.path.join(args.workdir, "sft-prompts.txt")
    with open(prompts, "w", encoding="utf-8") as f:
        f.writelines(r["instruction"] + "\n" for r in train)
    cmd = [
        "generate",
        "--load",
        save,
        "--tokenizer-name-or-path",
        tok_dir,
        "--prompt-type",
        PROMPT_TYPE,
        "--prompts-file",
        prompts,
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
        "--tensor-model-parallel-size",
        str(args.nproc_per_node),
        *(["--task", "do_sample", "--temperature", "1.0"] if sample else []),
    ]
    print(f"{step} anyspeed {' '.join(cmd)}", flush=True)
    # A one-process posttrain made this process rank 0 of a world of one: not the child's.
    env = {k: v for k, v in os.environ.items() if k not in single_process_env()}
    out = subprocess.run(
        [sys.executable, "-m", "anyspeed", *cmd], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        return _parse(out.stdout, [r["instruction"] for r in train]) if out.returncode == 0 else []
    except ValueError:  # a prompt's answer is missing from the output
        print(f"demo: anyspeed generate did not answer every prompt:\n{out.stdout}", flush=True)
        return []


def _parse(text: str, prompts: list[str]) -> list[str]:
    """The answers in ``anyspeed generate``'s output: ``prompt: P`` then the answer, per
    prompt, in order."""
    answers, pos = [], 0
    heads = [f"prompt: {p}\n" for p in prompts]
    for i, head in enumerate(heads):
        start = text.index(head, pos) + len(head)
        end = text.find(heads[i + 1], start) if i + 1 < len(heads) else len(text)
        answers.append(text[start:end].removesuffix("\n").removesuffix("\n"))
        pos = end
    return answers


def show_answer(train: list[dict], answers: list[str]) -> None:
    """One question (the first "What does ..." one) with the expected and generated answer,
    and how many trained prompts were answered exactly."""
    i = next((k for k, r in enumerate(train) if r["instruction"].startswith("What")), 0)
    right = sum(a == r["output"] for a, r in zip(answers, train, strict=True))
    print(f"demo: prompt:   {train[i]['instruction']}")
    print(f"demo: expected: {train[i]['output']}")
    print(f"demo: answer:   {answers[i]}")
    print(
        f"demo: the answer {'matches' if answers[i] == train[i]['output'] else 'DIFFERS'}; "
        f"{right} of {len(train)} trained prompts answered exactly"
    )


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """The whole SFT demo for the parsed demo flags; ``extra`` goes to ``anyspeed posttrain``."""
    t0 = time.perf_counter()
    rc, save, tok_dir, train = sft_model(args, extra, 6)
    if rc == 0:
        answers = generated_answers(args, save, tok_dir, train)
        if answers:
            show_answer(train, answers)
        rc = 0 if answers else 1
    print(f"demo finished in {time.perf_counter() - t0:.0f} s (exit {rc}); checkpoint in {save}")
    return rc


def sft_model(
    args: argparse.Namespace, extra: list[str], steps: int
) -> tuple[int, str, str, list[dict]]:
    """Steps 1-5: tokenizer, instruction set, ``anyspeed posttrain --stage sft``; 1 unless the
    response loss has clearly fallen. (exit code, checkpoint, tokenizer, records trained on)."""
    from anyspeed.commands.train import posttrain as posttrain_main

    save = os.path.join(args.workdir, "sft-checkpoints")
    rc, tok_dir = tokenizer_steps(args.workdir, args.corpus_mb or 6.0, steps)
    if rc:
        return rc, save, tok_dir, []
    rc, prefix, train = _data(args, tok_dir, steps)
    if rc:
        return rc, save, tok_dir, train
    metrics = fresh_metrics(os.path.join(args.workdir, "sft-metrics.jsonl"))
    n, iters, samples = args.nproc_per_node, args.sft_iters or 100, len(train)
    cmd = [
        "--nproc-per-node",
        str(n),
        "--stage",
        "sft",
        "--is-instruction-dataset",
        "--prompt-type",
        PROMPT_TYPE,
        *DEMO_ARCH,
        *tp_layout(n),
        "--padded-vocab-size",
        str(VOCAB),
        "--micro-batch-size",
        str(math.gcd(samples, 16)),
        "--global-batch-size",
        str(samples),
        "--train-iters",
        str(iters),
        *SFT_TRAIN,
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
    print(f"[5/{steps}] anyspeed posttrain {' '.join(cmd)}", flush=True)
    rc = posttrain_main(cmd)
    if rc == 0:
        fell, _ = loss_fell(metrics, "SFT loss on the responses")
        rc = 0 if fell else 1
    return rc, save, tok_dir, train
