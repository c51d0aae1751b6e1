"""The allowed range of every numeric flag of every stage, checked once after parsing.

A size of 0 or a negative learning rate otherwise surfaces as a traceback deep in Megatron (or,
for ``--seq-length 0``, as a SIGFPE with no message). :data:`RANGES` holds one row per numeric
flag a stage's parser accepts, ``anyspeed pretrain``'s and each post-training stage's (a test
keeps it complete); :func:`check_ranges` turns the first value out of range, or a number that is
not finite, into one :class:`UsageError` line naming the flag, the bound and the value.
``--split`` (weights, not a number) is checked here too.
"""

from __future__ import annotations

import argparse
import math
import operator
from dataclasses import dataclass
from typing import Any

from anyspeed.errors import UsageError


@dataclass(frozen=True)
class Range:
    """Bounds of one flag: ``ge``/``gt`` below, ``le``/``lt`` above (None: unbounded)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def violation(self, value: float) -> str | None:
        """What ``value`` breaks ("must be >= 1"), or None when it is in range."""
        bounds = (
            (self.ge, ">=", operator.ge),
            (self.gt, ">", operator.gt),
            (self.le, "<=", operator.le),
            (self.lt, "<", operator.lt),
        )
        for bound, name, ok in bounds:
            if bound is not None and not ok(value, bound):
                return f"must be {name} {_num(bound)}"
        return None


POSITIVE = Range(ge=1)  # a size or a count of at least one
COUNT = Range(ge=0)  # zero allowed (0 = none / off)
NONNEG = Range(ge=0.0)
FRACTION = Range(ge=0.0, le=1.0)
PROBABILITY = Range(ge=0.0, lt=1.0)  # dropout, Adam betas
STRICTLY_POSITIVE = Range(gt=0.0)
HALF = Range(ge=0.0, lt=0.5)  # label smoothing, a clip ratio

RANGES: dict[str, Range] = {
    # launch and parallelism
    "--nproc-per-node": POSITIVE,
    "--tensor-model-parallel-size": POSITIVE,
    "--pipeline-model-parallel-size": POSITIVE,
    "--context-parallel-size": POSITIVE,
    "--ulysses-degree-in-cp": POSITIVE,
    "--num-layers-per-virtual-pipeline-stage": POSITIVE,
    "--ddp-bucket-size": POSITIVE,
    "--distributed-timeout-minutes": STRICTLY_POSITIVE,
    "--optimization-level": Range(ge=0, le=2),
    # architecture and tokenizer
    "--num-layers": POSITIVE,
    "--hidden-size": POSITIVE,
    "--ffn-hidden-size": POSITIVE,
    "--num-attention-heads": POSITIVE,
    "--num-query-groups": POSITIVE,
    "--kv-channels": POSITIVE,
    "--max-position-embeddings": POSITIVE,
    "--seq-length": POSITIVE,
    "--padded-vocab-size": POSITIVE,
    "--vocab-size": POSITIVE,
    "--make-vocab-size-divisible-by": POSITIVE,
    "--rotary-base": POSITIVE,
    "--rotary-percent": Range(gt=0.0, le=1.0),
    "--rope-scaling-factor": STRICTLY_POSITIVE,
    "--norm-epsilon": STRICTLY_POSITIVE,
    "--init-method-std": NONNEG,
    "--hidden-dropout": PROBABILITY,
    "--attention-dropout": PROBABILITY,
    # uneven pipeline stages
    "--decoder-first-pipeline-num-layers": POSITIVE,
    "--decoder-last-pipeline-num-layers": POSITIVE,
    # multi-latent attention
    "--q-lora-rank": POSITIVE,
    "--mtp-num-layers": POSITIVE,
    "--mtp-loss-scaling-factor": NONNEG,
    "--kv-lora-rank": POSITIVE,
    "--linear-conv-kernel-dim": POSITIVE,
    "--linear-key-head-dim": POSITIVE,
    "--linear-value-head-dim": POSITIVE,
    "--linear-num-key-heads": POSITIVE,
    "--linear-num-value-heads": POSITIVE,
    "--dsa-indexer-n-heads": POSITIVE,
    "--dsa-indexer-head-dim": POSITIVE,
    "--dsa-indexer-topk": POSITIVE,
    "--dsa-indexer-loss-coeff": NONNEG,
    "--qk-head-dim": POSITIVE,
    "--qk-pos-emb-head-dim": POSITIVE,
    "--v-head-dim": POSITIVE,
    "--rotary-scaling-factor": STRICTLY_POSITIVE,
    "--mscale": STRICTLY_POSITIVE,
    "--mscale-all-dim": NONNEG,
    "--yarn-original-max-position-embeddings": POSITIVE,
    "--yarn-beta-fast": STRICTLY_POSITIVE,
    "--yarn-beta-slow": STRICTLY_POSITIVE,
    "--window-size": Range(ge=0),  # keys before the row (0: the row itself)
    "--glu-linear-offset": NONNEG,  # GPT-OSS: 1
    "--activation-func-clamp-value": STRICTLY_POSITIVE,  # GPT-OSS: 7
    "--attn-logit-softcapping": STRICTLY_POSITIVE,  # Gemma 2: 50
    "--output-logit-softcapping": STRICTLY_POSITIVE,  # Gemma 2: 30
    "--query-pre-attn-scalar": STRICTLY_POSITIVE,  # Gemma 2: 256 (27B: 144)
    "--interleave-sliding-window": POSITIVE,  # MindSpeed-LLM's Gemma 2: 4096
    "--rotary-base-local": STRICTLY_POSITIVE,  # Gemma 3: 10000
    "--rotary-seq-len-interpolation-factor": STRICTLY_POSITIVE,  # Gemma 3 (4B+): 8
    "--rope-scaling-mscale": STRICTLY_POSITIVE,
    "--rope-scaling-mscale-all-dim": NONNEG,
    "--rope-scaling-original-max-position-embeddings": POSITIVE,  # YaRN's; LongRoPE's: 4096
    "--long-factor": STRICTLY_POSITIVE,  # LongRoPE (Phi-3.5): each factor
    "--short-factor": STRICTLY_POSITIVE,
    "--long-mscale": STRICTLY_POSITIVE,  # MiniCPM3's (refused)
    "--short-mscale": STRICTLY_POSITIVE,
    "--rope-scaling-beta-fast": STRICTLY_POSITIVE,
    "--beta-fast": STRICTLY_POSITIVE,
    "--index-n-heads": POSITIVE,
    "--index-head-dim": POSITIVE,
    "--index-topk": POSITIVE,
    "--indexer-loss-coeff": NONNEG,
    "--beta-slow": STRICTLY_POSITIVE,
    "--rope-scaling-beta-slow": STRICTLY_POSITIVE,
    # mixture of experts
    "--expert-model-parallel-size": POSITIVE,
    "--expert-tensor-parallel-size": POSITIVE,
    "--num-experts": POSITIVE,
    "--moe-ffn-hidden-size": POSITIVE,
    "--moe-router-topk": POSITIVE,
    "--moe-shared-expert-intermediate-size": POSITIVE,
    "--moe-router-topk-scaling-factor": STRICTLY_POSITIVE,
    "--moe-router-num-groups": POSITIVE,
    "--moe-router-group-topk": POSITIVE,
    "--moe-aux-loss-coeff": NONNEG,
    "--moe-z-loss-coeff": NONNEG,
    "--moe-router-bias-update-rate": STRICTLY_POSITIVE,
    "--n-shared-experts": POSITIVE,
    "--moe-expert-capacity-factor": STRICTLY_POSITIVE,
    "--first-k-dense-replace": Range(ge=-1),  # MindSpeed-LLM's -1: no dense layer
    # memory (recompute, swap)
    "--recompute-num-layers": POSITIVE,
    "--recompute-activation-function-num-layers": POSITIVE,
    "--recompute-norm-num-layers": POSITIVE,
    "--swap-optimizer-times": POSITIVE,
    # FP8 GEMMs (features/fp8)
    "--fp8-margin": COUNT,
    "--fp8-amax-history-len": POSITIVE,
    "--num-layers-at-start-in-bf16": COUNT,
    "--num-layers-at-end-in-bf16": COUNT,
    # training
    "--micro-batch-size": POSITIVE,
    "--global-batch-size": POSITIVE,
    "--train-iters": COUNT,
    "--lr": NONNEG,
    "--min-lr": NONNEG,
    "--lr-decay-iters": COUNT,
    "--lr-warmup-fraction": FRACTION,
    "--lr-warmup-iters": COUNT,
    "--lr-warmup-init": NONNEG,
    "--lr-wsd-decay-iters": COUNT,
    "--weight-decay": NONNEG,
    "--clip-grad": NONNEG,  # 0: no clipping
    "--adam-beta1": PROBABILITY,
    "--adam-beta2": PROBABILITY,
    "--adam-eps": STRICTLY_POSITIVE,
    "--loss-scale": STRICTLY_POSITIVE,
    "--initial-loss-scale": STRICTLY_POSITIVE,
    "--min-loss-scale": STRICTLY_POSITIVE,
    "--loss-scale-window": POSITIVE,
    "--hysteresis": POSITIVE,
    "--muon-momentum": Range(ge=0, lt=1),
    "--muon-num-ns-steps": POSITIVE,
    "--muon-extra-scale-factor": STRICTLY_POSITIVE,
    "--seed": Range(ge=0, lt=2**31),  # numpy seeds are 32-bit; stages add an offset
    # checkpoints, logging, evaluation, sampling
    "--save-interval": POSITIVE,
    "--exit-interval": POSITIVE,
    "--log-interval": POSITIVE,
    "--eval-interval": POSITIVE,
    "--manual-gc-interval": COUNT,
    "--eval-iters": COUNT,
    "--generate-tokens": POSITIVE,
    "--profile-step-start": COUNT,
    "--profile-step-end": POSITIVE,
    "--profile-ranks": COUNT,
    # post-training: LoRA and the reference (every stage)
    "--lora-r": POSITIVE,
    # on-the-fly preprocessing (a raw --data-path)
    "--workers": POSITIVE,
    "--n-subs": POSITIVE,
    "--pad-to-multiple-of": POSITIVE,
    # MindSpeed-LLM's Qwen3-Next spelling (0: its default, off)
    "--full-attention-interval": COUNT,
    "--partial-rotary-factor": FRACTION,
    "--mamba-d-conv": POSITIVE,
    "--moe-zero-memory-num-layers": COUNT,
    "--lora-alpha": STRICTLY_POSITIVE,
    "--lora-dropout": PROBABILITY,
    "--refer-model-iter": COUNT,
    # DPO, SimPO (their betas scale a log-sigmoid: 0 or below learns nothing or the reverse)
    "--dpo-beta": STRICTLY_POSITIVE,
    "--dpo-label-smoothing": HALF,
    "--pref-ftx": NONNEG,  # a negative weight would train the chosen answer's likelihood down
    "--simpo-beta": STRICTLY_POSITIVE,
    "--simpo-label-smoothing": HALF,
    "--gamma-beta-ratio": NONNEG,
    # GRPO
    "--n-samples-per-prompt": POSITIVE,  # GRPO's plan refuses 1 (no group-normalised advantage)
    "--rollout-batch-size": POSITIVE,
    "--mini-batch-size": POSITIVE,
    "--ppo-epochs": POSITIVE,
    "--max-prompt-length": POSITIVE,
    "--max-response-length": POSITIVE,
    "--clip-ratio": HALF,
    "--clip-ratio-high": NONNEG,
    "--init-kl-coef": NONNEG,
    "--entropy-coeff": NONNEG,
    "--temperature": STRICTLY_POSITIVE,
    "--top-k": COUNT,  # 0: off
    "--top-p": Range(gt=0.0, le=1.0),
    "--overlong-buffer-len": COUNT,
    "--overlong-penalty-factor": NONNEG,
    "--max-num-gen-batches": POSITIVE,
    "--verifier-weight": Range(),  # any finite weight (a penalty may be negative)
    "--reward-model-weight": Range(),
    "--prm-weight": Range(),
    "--infer-tensor-parallel-size": POSITIVE,
    "--infer-pipeline-parallel-size": POSITIVE,
    "--infer-expert-parallel-size": POSITIVE,
    "--reward-tensor-parallel-size": POSITIVE,
    "--reward-pipeline-parallel-size": POSITIVE,
    "--max-tool-calls": POSITIVE,
    "--max-tool-response-length": POSITIVE,
    "--tool-timeout": STRICTLY_POSITIVE,
    "--rollout-is-threshold": STRICTLY_POSITIVE,
    # PPO
    "--gamma": FRACTION,
    "--lam": FRACTION,
    "--critic-lr": NONNEG,
    "--cliprange-value": NONNEG,
    "--max-packing-token-size": POSITIVE,
    "--partial-rollout-max-split": POSITIVE,
    "--critic-warmup": COUNT,
    "--clip-ratio-c": NONNEG,
    "--rollout-rs-threshold": STRICTLY_POSITIVE,
    "--rollout-rs-threshold-lower": STRICTLY_POSITIVE,
    # on-policy distillation
    "--distill-coef": STRICTLY_POSITIVE,
    "--distill-topk": POSITIVE,
    # vision-language
    "--max-image-pixels": POSITIVE,
    "--image-min-pixels": POSITIVE,
    "--image-max-pixels": POSITIVE,
    "--mrope-section": POSITIVE,
}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def _flag_values(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> list[tuple[str, Any]]:
    """(flag, value) for every flag in :data:`RANGES` that ``parser`` defines and was given
    a value (flags left at a None default are skipped)."""
    out = []
    for action in parser._actions:
        for flag in action.option_strings:
            if flag in RANGES:
                value = getattr(args, action.dest, None)
                if value is not None:
                    out.append((flag, value))
                break
    return out


def check_ranges(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """UsageError (one line) for the first numeric flag out of its range, a float that is not
    finite, or a ``--split`` that is not N[,N[,N]] non-negative weights with a positive sum."""
    for flag, given in _flag_values(args, parser):
        for value in given if isinstance(given, (list, tuple)) else [given]:  # lists: each value
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"{flag} must be a finite number (got {value})")
            why = RANGES[flag].violation(value)
            if why:
                raise UsageError(f"{flag} {why} (got {_num(value)})")
    split = getattr(args, "split", None)
    if split is not None:
        check_split_weights(split)


def check_split_weights(split: str) -> list[float]:
    """``--split`` as up to three non-negative weights with a positive sum (UsageError if not)."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not weights or len(weights) > 3 or not all(math.isfinite(w) for w in weights):
        raise UsageError(f"--split {split!r}: give up to three weights, e.g. 969,30,1")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UsageError(
            f"--split {split!r}: the weights must be >= 0 and not all zero (e.g. 969,30,1)"
        )
    return weights
