"""``anyspeed demo --ppo``: RLHF offline: a reward model trained here from preference pairs, then
PPO with a critic against it.

1-4. the GRPO demo's corpus, tokenizer, addition task and data (``anyspeed.demo.grpo``);
5. preference pairs from the training questions: ``#### a+b`` chosen, the bare number or a
   wrong ``#### n`` rejected, preprocessed as pairs;
6. ``anyspeed posttrain --stage sft``: the GRPO demo's SFT model;
7. ``anyspeed posttrain --stage orm`` from it on the pairs: the reward model;
8. the held-out greedy accuracy before PPO;
9. ``anyspeed posttrain --stage ppo`` from the SFT model with ``--reward-model`` (the reward
   model's score is the only reward, the KL to the SFT model in it), the critic started from
   the reward model and warmed up for two rollouts;
10. the held-out accuracy after, the reward model's mean score and the critic's explained
    variance (the last 5 steps) before and after.

The reward model learns the credited form, not the sums (about 75% pair accuracy: all of the
bare-number pairs, half of the wrong-sum ones), so PPO raises its score by adopting the form
while the sums drift: the held-out accuracy shows what optimising a weak reward model does.

It fails (exit 1) unless the mean reward rose. Extra flags go to the PPO run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from anyspeed.demo import grpo
from anyspeed.demo.common import (
    FINETUNE,
    fresh_metrics,
    tokenizer_steps,
)
from anyspeed.demo.instructions import write_jsonl
from anyspeed.demo.sft import preprocess

STEPS = 10
ORM_TRAIN = [
    "--lr",
    "1e-3",
    "--lr-decay-style",
    "constant",
    "--weight-decay",
    "0",
    *FINETUNE,
    "--log-interval",
    "20",
    "--micro-batch-size",
    "32",
    "--global-batch-size",
    "64",
    "--is-pairwise-dataset",
    "--variable-seq-lengths",
]
ORM_ITERS = 120
PPO_TRAIN = [
    "--lr",
    "1e-4",
    "--critic-lr",
    "1e-3",
    "--lr-decay-style",
    "constant",
    "--weight-decay",
    "0",
    *FINETUNE,
    "--log-interval",
    "1",
    "--n-samples-per-prompt",
    "4",
    "--rollout-batch-size",
    "32",
    "--global-batch-size",
    "128",
    "--micro-batch-size",
    "32",
    "--max-response-length",
    "8",
    "--temperature",
    "0.5",
    "--init-kl-coef",
    "0.1",
    "--use-kl-in-reward",
    "--critic-warmup",
    "2",
]


def pairs(train: list[dict], seed: int = 1) -> list[dict]:
    """Two pairs per question, shuffled: the credited answer chosen over the bare number, and
    over a wrong sum in the credited form."""
    rng = random.Random(seed)
    out = []
    for r in train:
        n = int(r["output"].split()[-1])
        wrong = f"#### {n + rng.choice((-3, -2, -1, 1, 2, 3))}"
        for rejected in (str(n), wrong):
            out.append(
                {
                    "instruction": r["instruction"],
                    "input": "",
                    "chosen": r["output"],
                    "rejected": rejected,
                }
            )
    rng.shuffle(out)
    return out


def _pairs(args: argparse.Namespace, tok_dir: str) -> tuple[int, str]:
    train, _ = grpo.task()
    src = write_jsonl(os.path.join(args.workdir, "ppo-pairs.jsonl"), pairs(train))
    prefix = os.path.join(args.workdir, "ppo-pairs")
    rc = preprocess(src, prefix, tok_dir, "AlpacaStylePairwiseHandler")
    if rc == 0:
        print(
            f"[5/{STEPS}] preference pairs: '#### a+b' chosen, the bare number or a wrong "
            f"'#### n' rejected -> {prefix}_packed_{{chosen,rejected}}_*",
            flush=True,
        )
    return rc, prefix


def _train(
    stage: str,
    common: list[str],
    flags: list[str],
    iters: int,
    data: str,
    save: str,
    step: int,
    extra: list[str] = (),
) -> int:
    """``anyspeed posttrain --stage STAGE`` saved at its last step; its exit code."""
    from anyspeed.commands.train import posttrain

    cmd = [
        "--stage",
        stage,
        *common,
        *flags,
        "--train-iters",
        str(iters),
        "--data-path",
        data,
        "--save",
        save,
        "--save-interval",
        str(iters),
        *extra,
    ]
    print(f"[{step}/{STEPS}] anyspeed posttrain {' '.join(cmd)}", flush=True)
    return posttrain(cmd)


def _metrics(path: str, key: str) -> list[float]:
    with open(path, encoding="utf-8") as f:
        return [r[key] for r in map(json.loads, f) if key in r]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _critic(ev: list[float], loss: list[float]) -> str:
    """How well the critic predicted the returns: its explained variance at step 1, over its
    best 5 steps in a row and over the last 5, and its value loss at step 1 and the last 5.
    Once the policy settles on one answer the returns hardly vary; the explained variance, a
    share of that variance, then swings around 0 while the value loss shows the fit."""
    best = max(_mean(ev[i : i + 5]) for i in range(max(1, len(ev) - 4)))
    return (
        f"critic explained variance {ev[0]:.2f} (step 1) -> {best:.2f} (its best 5 steps in a "
        f"row), {_mean(ev[-5:]):.2f} (the last 5); value loss {loss[0]:.3f} -> "
        f"{_mean(loss[-5:]):.3f} (the last 5 steps)"
    )


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """The whole PPO demo; ``extra`` goes to ``anyspeed posttrain --stage ppo``."""
    t0 = time.perf_counter()
    rc, tok_dir = tokenizer_steps(args.workdir, args.corpus_mb or 1.0, STEPS)
    if rc:
        return rc
    rc, sft_prefix, rl_prefix, held = grpo.task_data(args, tok_dir, STEPS, "PPO")
    rc = rc or _pairs(args, tok_dir)[0]
    if rc:
        return rc
    pair_prefix = os.path.join(args.workdir, "ppo-pairs")
    common = grpo.common_flags(args, tok_dir)
    sft_save = grpo.sft(args, common, sft_prefix, f"[6/{STEPS}]")
    if sft_save is None:
        return 1
    orm_save = os.path.join(args.workdir, "ppo-reward-model")
    orm = ["--load", sft_save, "--finetune", *ORM_TRAIN]
    if _train("orm", common, orm, ORM_ITERS, pair_prefix, orm_save, 7):
        return 1
    before = grpo.heldout(args, sft_save, tok_dir, held, f"[8/{STEPS}]")
    save = os.path.join(args.workdir, "ppo-checkpoints")
    metrics = fresh_metrics(os.path.join(args.workdir, "ppo-metrics.jsonl"))
    flags = [
        "--load",
        sft_save,
        "--finetune",
        *PPO_TRAIN,
        "--reward-model",
        orm_save,
        "--critic-load",
        orm_save,
        "--metrics-file",
        metrics,
    ]
    if _train("ppo", common, flags, args.train_iters or 50, rl_prefix, save, 9, extra):
        return 1
    after = grpo.heldout(args, save, tok_dir, held, f"[10/{STEPS}]")
    r, ev = _metrics(metrics, "grpo/rewards/mean"), _metrics(metrics, "critic/vf_explained_var")
    loss = _metrics(metrics, "critic/vf_loss")
    if not r or not ev or not loss or before is None or after is None:
        return 1
    print(
        f"demo: reward model's mean score {r[0]:.2f} (step 1, before any update) -> "
        f"{_mean(r[-5:]):.2f} (the last 5 steps); {_critic(ev, loss)}; "
        f"held-out greedy accuracy {before:.2f} -> {after:.2f}"
    )
    last = _mean(r[-5:])
    rc = 0 if last > r[0] else 1
    print(f"demo finished in {time.perf_counter() - t0:.0f} s (exit {rc}); checkpoint in {save}")
    return rc
