"""``anyspeed demo``: the whole LLM workflow offline, on files every machine has.

1. corpus: the Python standard library's own source files in a seeded shuffle, as jsonl; the
   validation and test documents (the last ones, for Megatron's ``--split``) are picked evenly
   across the library's sorted file list, and named in the output;
2. ``anyspeed train-tokenizer``: a byte-level BPE tokenizer (a standard HF directory);
3. ``anyspeed preprocess``: Megatron ``.bin/.idx``;
4. ``anyspeed pretrain``: a small Qwen2.5-architecture model on N CPU processes (TP=N, sequence
   parallel), with validation, a checkpoint and a generated sample.

It fails (exit 1) unless the loss has clearly fallen. Extra flags go to ``anyspeed pretrain``
and win over the demo's. ``--sft`` fine-tunes instead (``anyspeed.demo.sft``), ``--dpo`` then
runs DPO from the fine-tuned model (``anyspeed.demo.dpo``), ``--moe`` trains a
mixture-of-experts model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from anyspeed.demo.common import (
    DEMO_MODEL,
    DEMO_MOE,
    PROMPT,
    VOCAB,
    fresh_metrics,
    loss_fell,
    tokenizer_steps,
    tp_layout,
)


def parser() -> argparse.ArgumentParser:
    """The demo's own flags; every other flag goes to ``anyspeed pretrain``/``posttrain``."""
    p = argparse.ArgumentParser(prog="anyspeed demo", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="anyspeed-demo", help="where data and checkpoints go")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="training iterations (default 400; 100 with --sft; 40 DPO iterations with --dpo; "
        "80 GRPO steps with --tools; 50 distillation steps with --distill; 40 GRPO steps "
        "with --prm)",
    )
    p.add_argument(
        "--corpus-mb",
        type=float,
        default=None,
        help="MiB of the standard library to train the tokenizer on (default 6; "
        "--grpo: 1, what its page measures)",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help="a Qwen3-MoE-style model, experts over the processes (EP=N)",
    )
    _posttrain_demos(p)
    p.add_argument(
        "--mm",
        action="store_true",
        help="a vision-language model (LLaVA) captioning drawn shapes, trained on "
        "the processes (data parallel)",
    )
    p.add_argument(
        "--family",
        choices=("llava", "qwen2_vl", "qwen2_5_vl"),
        default="llava",
        help="with --mm: the vision-language family (default llava)",
    )
    p.add_argument(
        "--sft-iters",
        type=int,
        default=None,
        help="with --dpo/--grpo/--ppo/--tools/--distill/--prm: SFT iterations first (default "
        "100/300/300/300/300/300; --distill: the teacher's and the student's)",
    )
    p.add_argument(
        "--sft-samples",
        type=int,
        default=32,
        help="with --sft: how many instructions to train on and answer (default 32)",
    )
    return p


def _posttrain_demos(p: argparse.ArgumentParser) -> None:
    """The flags that pick a post-training demo (each starts from a short SFT)."""
    p.add_argument(
        "--sft",
        action="store_true",
        help="supervised fine-tuning on an instruction set from the stdlib, then "
        "answer one of its prompts",
    )
    p.add_argument(
        "--dpo",
        action="store_true",
        help="the SFT demo, then DPO on a preference set built from its questions "
        "(the expected answer preferred to another function's)",
    )
    p.add_argument(
        "--grpo",
        action="store_true",
        help="a verifiable addition task: a short SFT, then GRPO with a rule reward "
        "(held-out accuracy before and after)",
    )
    p.add_argument(
        "--ppo",
        action="store_true",
        help="RLHF on the --grpo task: a reward model trained from preference pairs, then PPO "
        "with a critic against it (reward and held-out accuracy before and after)",
    )
    p.add_argument(
        "--distill",
        action="store_true",
        help="on-policy distillation on the --grpo task: a 6-layer teacher fine-tuned on the "
        "credited answers, then the 4-layer student distilled from it with no reward "
        "(its KL to the teacher and held-out accuracy before and after)",
    )
    p.add_argument(
        "--prm",
        action="store_true",
        help="a process reward model trained on step-labelled counting solutions, then GRPO "
        "with its step scores as the only reward (the policy's right steps before and after)",
    )
    p.add_argument(
        "--tools",
        action="store_true",
        help="multi-turn RL with a calculator: 3-digit x 2-digit products the model cannot do "
        "alone; a short SFT, then GRPO whose rollouts call the tool (reward before and after)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``anyspeed demo``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser().parse_known_args(argv)
    from anyspeed.errors import UsageError, report

    tuned = (args.sft, args.dpo, args.grpo, args.ppo, args.tools, args.distill, args.prm)
    if any(tuned) and args.moe:
        return report(
            "anyspeed demo", UsageError("--sft/--dpo fine-tune the dense demo model; drop --moe")
        )
    if args.sft_samples < 1:
        return report(
            "anyspeed demo",
            UsageError(
                f"--sft-samples {args.sft_samples}: give at least 1 instruction to train on"
            ),
        )
    if args.family != "llava" and not args.mm:
        return report("anyspeed demo", UsageError("--family picks the --mm model: add --mm"))
    if args.mm and args.family != "llava":
        from anyspeed.demo.mm_qwen import run

        return run(args, extra)
    if args.mm:
        from anyspeed.demo.mm import run

        return run(args, extra)
    if args.grpo:
        from anyspeed.demo.grpo import run

        return run(args, extra)
    if args.ppo:
        from anyspeed.demo.ppo import run

        return run(args, extra)
    if args.distill:
        from anyspeed.demo.distill import run

        return run(args, extra)
    if args.prm:
        from anyspeed.demo.prm import run

        return run(args, extra)
    if args.tools:
        from anyspeed.demo.tools import run

        return run(args, extra)
    if args.dpo:
        from anyspeed.demo.dpo import run

        return run(args, extra)
    if args.sft:
        from anyspeed.demo.sft import run

        args.sft_iters = args.train_iters
        return run(args, extra)
    return _pretrain(args, extra)


def _pretrain(args: argparse.Namespace, extra: list[str]) -> int:
    from anyspeed.argv import get_flag
    from anyspeed.commands.preprocess import main as data_main
    from anyspeed.commands.train import pretrain as pretrain_main

    t0 = time.perf_counter()
    split = get_flag([*DEMO_MODEL, *extra], "--split")
    rc, tok_dir = tokenizer_steps(args.workdir, args.corpus_mb or 6.0, 4, split)
    if rc:
        return rc
    corpus = os.path.join(args.workdir, "stdlib.jsonl")
    prefix = os.path.join(args.workdir, "stdlib")
    rc = data_main(
        [
            "preprocess",
            "--input",
            corpus,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "PretrainedFromHF",
            "--tokenizer-name-or-path",
            tok_dir,
            "--append-eod",
            "--workers",
            "2",
            "--overwrite",
            "--quiet",
        ]
    )
    if rc:
        return rc
    data = prefix + "_text_document"
    print(f"[3/4] preprocess: {data}.bin/.idx")
    save = os.path.join(args.workdir, "checkpoints")
    metrics = fresh_metrics(os.path.join(args.workdir, "metrics.jsonl"))
    n, iters = args.nproc_per_node, args.train_iters or 400
    model = list(DEMO_MODEL)
    layout = tp_layout(n)
    if args.moe:
        model[model.index("tiny-qwen2.5")] = "tiny-qwen3-moe"
        layout = ["--expert-model-parallel-size", str(n), *DEMO_MOE]
    cmd = [
        "--nproc-per-node",
        str(n),
        *model,
        *layout,
        "--padded-vocab-size",
        str(VOCAB),
        "--train-iters",
        str(iters),
        "--tokenizer-type",
        "PretrainedFromHF",
        "--tokenizer-name-or-path",
        tok_dir,
        "--data-path",
        data,
        "--save",
        save,
        "--save-interval",
        str(iters),
        "--generate-prompt",
        PROMPT,
        "--generate-tokens",
        "48",
        "--metrics-file",
        metrics,
        *extra,
    ]
    print(f"[4/4] anyspeed pretrain {' '.join(cmd)}", flush=True)
    rc = pretrain_main(cmd)
    if rc == 0:
        fell, rows = loss_fell(metrics, "lm loss")
        if args.moe:
            load = max(r["expert_load_max_over_mean"] for r in rows)
            print(f"demo: expert load max/mean at most {load:.2f} over the logged iterations")
        rc = 0 if fell else 1
    print(f"demo finished in {time.perf_counter() - t0:.0f} s (exit {rc}); checkpoint in {save}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
