"""Rewards from a process reward model (``--process-reward-model``): an ``--stage prm``
checkpoint, or a Hugging Face ``*ForCausalLM`` PRM directory converted once, built frozen at the
training layout beside the policy, checked before start. Each step of a sampled answer gets
the PRM's score (:mod:`.step_scores`); ``--prm-aggregate`` (min, the weakest step, by default)
makes them the answer's, which, times ``--prm-weight``, adds to the rewards; with
``--prm-step-rewards`` each step instead credits the tokens up to its end (PPO: a token reward
there; GRPO: DeepSeekMath's process-supervision advantages)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import torch

from anyspeed.errors import UsageError
from anyspeed.training.task import FrozenModel

NAME = "process_reward_model"  # the frozen model's name in the trainer
FLAG = "--process-reward-model"
AGGREGATES = ("min", "mean", "last", "prod")


@dataclass(frozen=True)
class PRMSource:
    """A checked ``--process-reward-model``: where, its architecture (None: the policy's), its
    step tokens (texts and ids) and how steps are cut and scores combined."""

    path: str
    model: Any
    placeholder: str
    placeholder_id: int
    reward_ids: tuple[int, ...]
    separator: str
    aggregate: str
    weight: float
    dense: bool = False  # step credit per token (PPO: token rewards, GRPO: process supervision)


def check(args: argparse.Namespace) -> PRMSource | None:
    """``--process-reward-model``, checked before start (None: not given): a causal LM
    reading the policy's tokens whose step tokens are one token each; the tokens come from
    the flags, else from an ``--stage prm`` checkpoint's record, else Math-Shepherd's."""
    from anyspeed.data.process_reward import step_token_ids
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.stages.common.rl.frozen_lm import check_causal_lm

    if args.process_reward_model is None:
        if args.prm_step_rewards:
            raise UsageError("--prm-step-rewards needs --process-reward-model")
        return None
    tok = load_tokenizer(TokenizerSpec(name_or_path=args.tokenizer_name_or_path))
    path, own = check_causal_lm(args, args.process_reward_model, FLAG)
    placeholder, rewards = _step_tokens(args, path)
    ph, ids = step_token_ids(tok, placeholder, rewards, prefix="prm-")
    if len(ids) < 2:
        raise UsageError("--prm-reward-tokens: give two or more (the good one first)")
    if not args.prm_step_separator:
        raise UsageError("--prm-step-separator must not be empty (the steps' boundary, e.g. \\n)")
    return PRMSource(
        path,
        own,
        placeholder,
        ph,
        ids,
        args.prm_step_separator,
        args.prm_aggregate,
        args.prm_weight,
        _dense(args),
    )


def _step_tokens(args: argparse.Namespace, path: str) -> tuple[str, list[str]]:
    """The placeholder and reward tokens: the flags, the PRM record of the checkpoint (or of
    the Hugging Face export it was converted from), or Math-Shepherd's ``ки`` and ``+ -``."""
    import json

    from anyspeed.checkpoint.reads import read_common
    from anyspeed.convert.to_hf import PRM_RECORD

    common = read_common(path)
    hf = common.get("anyspeed_convert", {}).get("hf_config_json")  # converted from HF
    record = common.get(PRM_RECORD) or (json.loads(hf).get(PRM_RECORD) if hf else None) or {}
    placeholder = args.prm_placeholder_token or record.get("placeholder_token") or "ки"
    rewards = args.prm_reward_tokens or record.get("reward_tokens") or ["+", "-"]
    return placeholder, list(rewards)


def frozen(src: PRMSource) -> dict[str, FrozenModel]:
    """The frozen PRM the policy task asks the engine for."""
    return {NAME: FrozenModel(load=src.path, model=src.model)}


def _dense(args: argparse.Namespace) -> bool:
    """``--prm-step-rewards``, checked: step credit needs per-token advantages (PPO's GAE,
    GRPO's process supervision) and answers the model wrote alone."""
    if not args.prm_step_rewards:
        return False
    if args.stage not in ("ppo", "grpo"):
        raise UsageError(
            f"--prm-step-rewards with --stage {args.stage}: step rewards need per-token "
            "advantages (--stage ppo or grpo); drop the flag (the steps' scores then combine "
            "by --prm-aggregate)"
        )
    if args.tools:
        raise UsageError(
            "--prm-step-rewards with --tools: a step may end inside a tool's output; drop one"
        )
    if args.stage == "grpo" and args.importance_sampling_level == "sequence":
        raise UsageError(
            "--prm-step-rewards with --importance-sampling-level sequence: GSPO's sequence "
            "ratio takes one advantage per sequence; use sequence_token or token"
        )
    return True


def aggregate(scores: list[float], how: str) -> float:
    """An answer's score from its steps' (0 for an answer without a step)."""
    if not scores:
        return 0.0
    if how == "min":
        return min(scores)
    if how == "mean":
        return sum(scores) / len(scores)
    if how == "prod":
        return math.prod(scores)
    return scores[-1]


def dense(steps: list[tuple[int, float]], length: int, weight: float) -> list[float]:
    """Per answer token, ``weight`` x the score of each step ending there (0 elsewhere)."""
    out = [0.0] * length
    for at, score in steps:
        out[at] += weight * score
    return out


def step_advantages(
    steps: list[list[tuple[int, float]]],
    lengths: list[int],
    group: int,
    outcome: torch.Tensor,
    weight: float,
    estimator: str,
) -> list[list[float]]:
    """GRPO's process supervision (DeepSeekMath, 4.1.3): each group's step scores (times
    ``weight``) normalised over all its samples' steps as the outcome rewards are
    (``estimator``), and each answer token's advantage the sum of the normalised scores of
    the steps ending at or after it, plus its sequence's ``outcome`` advantage."""
    from anyspeed.stages.common.rl.objective import group_advantages

    out = []
    for g in range(0, len(steps), group):
        flat = [weight * v for s in steps[g : g + group] for _, v in s]
        scores = torch.tensor(flat, dtype=torch.float64)
        norm = iter(group_advantages(scores, len(flat), estimator).tolist())
        for i in range(g, g + group):
            adv = [float(outcome[i])] * lengths[i]
            for end, _ in steps[i]:
                r = next(norm)
                for t in range(end + 1):
                    adv[t] += r
            out.append(adv)
    return out


def token_terms(
    steps: list[list[tuple[int, float]]] | None,
    answers: list[list[int]],
    cfg: Any,
    outcome: torch.Tensor,
) -> tuple[list[list[float]] | None, list[list[float]] | None]:
    """(token rewards, token advantages) of a rollout's step scores: PPO's rewards where the
    steps end, or GRPO's process-supervision advantages; (None, None) without step credit."""
    from anyspeed.stages.common.rl.objective import GROUP_ADVANTAGES

    if steps is None or not cfg.process_reward.dense:
        return None, None
    src, lengths = cfg.process_reward, [len(a) for a in answers]
    if cfg.adv_estimator in GROUP_ADVANTAGES:
        est = cfg.adv_estimator
        return None, step_advantages(steps, lengths, cfg.group, outcome, src.weight, est)
    return [dense(s, n, src.weight) for s, n in zip(steps, lengths, strict=True)], None
