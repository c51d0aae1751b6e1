"""``anyspeed demo --prm``: a process reward model, then GRPO on its step scores alone, offline.

1-2. the demo corpus and tokenizer;
3. a counting task generated here: ``Count on from n.`` answered in 3 steps ``a + 1 = b``, one a
   line; in the written data a step is wrong (b off by one or two) a third of the time, and the
   chain goes on from the written b. Step labels: ``+`` right, ``-`` wrong;
4. ``anyspeed preprocess``: the step-labelled solutions (the prompt as the chat template renders
   it, then each step followed by ``$``: the layout GRPO's PRM scores answers in), the policy's
   SFT data (the same noisy solutions) and the prompts;
5. ``anyspeed posttrain --stage sft``: the policy learns to count, mistakes included;
6. its right steps on held-out prompts (sampled at temperature 1, checked by the exact rule);
7. ``anyspeed posttrain --stage prm``: the PRM, fine-tuned from the SFT policy;
8. its held-out step accuracy against always answering ``+``;
9. ``anyspeed posttrain --stage grpo --process-reward-model --prm-step-rewards``: the PRM's step
   scores are the only signal (no verifier), each step crediting the tokens up to its end
   (DeepSeekMath's process supervision);
10. the policy's held-out right steps after.

It fails (exit 1) unless the PRM beat the constant answer and the policy's right steps rose.
Extra flags go to the GRPO run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time

from anyspeed.demo import grpo
from anyspeed.demo.common import FINETUNE, fresh_metrics, tokenizer_steps
from anyspeed.demo.instructions import write_jsonl
from anyspeed.demo.sft import PROMPT_TYPE, generated_answers, preprocess

STEPS = 10
CHAIN = 3  # steps an answer
WRONG = 1 / 3  # the share of wrong steps in the written data
HELD_OUT = 64  # prompts (starting numbers) never trained on
PRM_ITERS = 250  # from the SFT policy at 5e-4: 0.95 right on its batches at 200, 0.99 at 300
PLACEHOLDER, REWARDS = "$", ("+", "-")  # "$": one token, also after a space, in this tokenizer
PRM_TRAIN = [
    *("--lr", "5e-4", "--lr-decay-style", "constant", "--weight-decay", "0", *FINETUNE),
    *("--log-interval", "50", "--micro-batch-size", "16", "--global-batch-size", "32"),
    *("--placeholder-token", PLACEHOLDER, "--reward-tokens", *REWARDS, "--seq-length", "64"),
]
GRPO_TRAIN = [
    *("--lr", "1e-4", "--lr-decay-style", "constant", "--weight-decay", "0", *FINETUNE),
    *("--log-interval", "1", "--n-samples-per-prompt", "8", "--global-batch-size", "128"),
    *("--micro-batch-size", "32", "--max-response-length", "32", "--rollout-batch-size", "16"),
    *("--temperature", "1.0", "--init-kl-coef", "0", "--seq-length", "128"),
    # DeepSeekMath's process supervision: with the weakest step as the answer's reward the
    # policy learnt to write 2 steps, not 3 (right steps 0.54 -> 0.35; PRM reward 0.26 -> 0.79)
    "--prm-step-rewards",
]


def chain(rng: random.Random, start: int) -> tuple[list[str], list[str]]:
    """A written solution from ``start``: its steps and their labels."""
    total, steps, labels = start, [], []
    for _ in range(CHAIN):
        right = rng.random() >= WRONG
        written = total + 1 if right else total + 1 + rng.choice((-2, -1, 1, 2))
        steps.append(f"{total} + 1 = {written}")
        labels.append(REWARDS[0] if right else REWARDS[1])
        total = written
    return steps, labels


def right_steps(prompt: str, answer: str) -> tuple[int, int]:
    """(right steps, steps) of an answer by the exact rule: each line ``a + 1 = b`` is right
    when a is the last number written (the start, first) and b = a + 1; up to 3 lines count."""
    total = int(re.findall(r"-?\d+", prompt)[0])
    right = 0
    for line in answer.strip().splitlines()[:CHAIN]:
        got = re.fullmatch(r"\s*(-?\d+) \+ 1 = (-?\d+)\s*", line)
        if got and int(got[1]) == total and int(got[2]) == total + 1:
            right += 1
        if got:
            total = int(got[2])
    return right, CHAIN


def prompt_text(question: str) -> str:
    """The prompt as the chat template renders it, up to the open answer."""
    from anyspeed.data.templates import TEMPLATES

    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": ""}]
    return TEMPLATES[PROMPT_TYPE].segments(messages)[0][0]


def records(n: int, starts: list[int], seed: int) -> tuple[list[dict], list[dict]]:
    """``n`` (step-labelled record, SFT record) pairs from ``starts``."""
    rng = random.Random(seed)
    prm, sft = [], []
    for _ in range(n):
        start = rng.choice(starts)
        steps, labels = chain(rng, start)
        question = f"Count on from {start}."
        marked = "\n".join(f"{s} {PLACEHOLDER}" for s in steps)
        prm.append({"input": prompt_text(question) + marked, "value": labels})
        sft.append({"instruction": question, "input": "", "output": "\n".join(steps)})
    return prm, sft


def task_data(args: argparse.Namespace, tok_dir: str) -> tuple[int, dict[str, str], dict]:
    """Steps 3-4: the data, preprocessed; (exit code, prefixes, held-out facts: the prompts
    and the share of ``+`` labels in the held-out steps)."""
    starts = list(range(100))
    random.Random(0).shuffle(starts)
    held, train = starts[:HELD_OUT], starts[HELD_OUT:]
    prm, sft = records(4096, train, 1)
    prm_held, _ = records(256, held, 2)
    prompts = [
        {
            "instruction": f"Count on from {s}.",
            "input": "",
            "output": "\n".join(f"{a} + 1 = {a + 1}" for a in range(s, s + CHAIN)),
        }
        for s in train
    ]  # the verifier's answer: unused, the PRM is the only reward
    print(
        f"[3/{STEPS}] task: 'Count on from n.' in {CHAIN} steps 'a + 1 = b', a third of the "
        f"written steps wrong; {len(train)} starts for training, {len(held)} held out",
        flush=True,
    )
    w, out = args.workdir, {}
    for name, recs in (("prm", prm), ("prm-held", prm_held), ("sft", sft), ("prompts", prompts)):
        path = write_jsonl(os.path.join(w, f"prm-{name}.jsonl"), recs)
        out[name] = os.path.join(w, f"prm-{name}")
        if name.startswith("prm"):  # the text as written: no template
            steps = ("--placeholder-token", PLACEHOLDER, "--reward-tokens", *REWARDS)
            rc = preprocess(
                path, out[name], tok_dir, "AlpacaStyleProcessRewardHandler", None, *steps
            )
        else:
            handler = (
                "AlpacaStyleInstructionHandler"
                if name == "sft"
                else "R1AlpacaStyleInstructionHandler"
            )
            rc = preprocess(path, out[name], tok_dir, handler)
        if rc:
            return rc, out, {}
    print(f"[4/{STEPS}] preprocess: {', '.join(out.values())} (_packed_*)", flush=True)
    plus = sum(v == REWARDS[0] for r in prm_held for v in r["value"]) / (CHAIN * len(prm_held))
    return 0, out, {"prompts": [{"instruction": f"Count on from {s}."} for s in held], "plus": plus}


def prm_accuracy(args: argparse.Namespace, common: list[str], save: str, held: str) -> float | None:
    """Step 8: the PRM's step accuracy on the held-out solutions (one step at learning rate 0
    over all of them, as ``anyspeed posttrain --stage prm`` reports it)."""
    from anyspeed.commands.train import posttrain as posttrain_main

    metrics = fresh_metrics(os.path.join(args.workdir, "prm-held-metrics.jsonl"))
    cmd = [
        "--stage",
        "prm",
        *common,
        "--load",
        save,
        "--finetune",
        *PRM_TRAIN,
        "--lr",
        "0",
        "--train-iters",
        "1",
        "--global-batch-size",
        "256",
        "--data-path",
        held,
        "--metrics-file",
        metrics,
    ]
    print(f"[8/{STEPS}] anyspeed posttrain {' '.join(cmd)}", flush=True)
    if posttrain_main(cmd):
        return None
    with open(metrics, encoding="utf-8") as f:
        return [r["acc"] for r in map(json.loads, f) if "acc" in r][0]


def step_accuracy(args: argparse.Namespace, save: str, tok_dir: str, held: dict, step: str):
    """The policy's share of right steps on the held-out prompts, sampled at temperature 1
    (None when generation failed)."""
    answers = generated_answers(args, save, tok_dir, held["prompts"], step, sample=True)
    if not answers:
        return None
    counts = [
        right_steps(p["instruction"], a) for p, a in zip(held["prompts"], answers, strict=True)
    ]
    acc = sum(r for r, _ in counts) / sum(n for _, n in counts)
    print(f"demo: held-out right steps {acc:.2f} (sampled at temperature 1); e.g. {answers[0]!r}")
    return acc


def train_prm(
    args: argparse.Namespace, common: list[str], policy: str, data: dict[str, str]
) -> tuple[str, float] | None:
    """Steps 7-8: the PRM, fine-tuned from the SFT policy on the step-labelled solutions (a
    PRM starts from a model that reads the task), and its held-out step accuracy; (its
    checkpoint, the accuracy), None when a step failed."""
    from anyspeed.commands.train import posttrain as posttrain_main

    save = os.path.join(args.workdir, "prm-checkpoints")
    cmd = ["--stage", "prm", *common, "--load", policy, "--finetune", *PRM_TRAIN]
    cmd += ["--train-iters", str(PRM_ITERS), "--data-path", data["prm"], "--save", save]
    cmd += ["--save-interval", str(PRM_ITERS)]
    print(f"[7/{STEPS}] anyspeed posttrain {' '.join(cmd)}", flush=True)
    if posttrain_main(cmd):
        return None
    acc = prm_accuracy(args, common, save, data["prm-held"])
    return None if acc is None else (save, acc)


def grpo_on_prm(
    args: argparse.Namespace,
    common: list[str],
    policy: str,
    prm: str,
    data: dict[str, str],
    extra: list[str],
) -> tuple[str, str] | None:
    """Step 9: GRPO from the policy with the PRM's step scores as its only signal; (its
    checkpoint, its metrics file), None when it failed."""
    from anyspeed.commands.train import posttrain as posttrain_main

    save = os.path.join(args.workdir, "prm-grpo-checkpoints")
    metrics = fresh_metrics(os.path.join(args.workdir, "prm-grpo-metrics.jsonl"))
    steps = args.train_iters or 40
    cmd = ["--stage", "grpo", *common, "--load", policy, "--finetune", *GRPO_TRAIN]
    cmd += ["--process-reward-model", prm, "--train-iters", str(steps), "--data-path"]
    cmd += [data["prompts"], "--save", save, "--save-interval", str(steps), "--metrics-file"]
    cmd += [metrics, *extra]
    print(f"[9/{STEPS}] anyspeed posttrain {' '.join(cmd)}", flush=True)
    return None if posttrain_main(cmd) else (save, metrics)


def step_scores(metrics: str) -> list[float]:
    """Each GRPO step's mean PRM step score over its rollout, from a metrics file."""
    with open(metrics, encoding="utf-8") as f:
        return [r["prm/step_score"] for r in map(json.loads, f) if "prm/step_score" in r]


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """The whole PRM demo; ``extra`` goes to ``anyspeed posttrain --stage grpo``."""
    t0 = time.perf_counter()
    rc, tok_dir = tokenizer_steps(args.workdir, args.corpus_mb or 1.0, STEPS)
    if rc:
        return rc
    rc, data, held = task_data(args, tok_dir)
    if rc:
        return rc
    common = grpo.common_flags(args, tok_dir)
    policy = grpo.sft(args, common, data["sft"], f"[5/{STEPS}]", "prm")
    if policy is None:
        return 1
    before = step_accuracy(args, policy, tok_dir, held, f"[6/{STEPS}]")
    trained = train_prm(args, common, policy, data)
    if trained is None:
        return 1
    prm_save, prm_acc = trained
    print(f"demo: the PRM's held-out step accuracy {prm_acc:.2f} (always '+': {held['plus']:.2f})")
    ran = grpo_on_prm(args, common, policy, prm_save, data, extra)
    if ran is None:
        return 1
    save, metrics = ran
    after = step_accuracy(args, save, tok_dir, held, f"[10/{STEPS}]")
    r = step_scores(metrics)
    if not r or before is None or after is None:
        return 1
    last = sum(r[-5:]) / len(r[-5:])
    print(
        f"demo: the PRM's mean step score {r[0]:.2f} (step 1) -> {last:.2f} (the last 5 "
        f"steps); held-out right steps {before:.2f} -> {after:.2f}"
    )
    rc = 0 if prm_acc > held["plus"] + 0.1 and after > before else 1
    print(f"demo finished in {time.perf_counter() - t0:.0f} s (exit {rc}); checkpoint in {save}")
    return rc
