"""``--stage distill``'s flags: the RL stages' shared ones (rollout, objective, rewards,
reference, rollout correction) with distillation's defaults, and the teacher's."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from anyspeed.errors import UsageError
from anyspeed.stages.common.rl import flags as rl_flags
from anyspeed.stages.common.rl import objective as L

UPDATES = ("policy-gradient", "supervised", "topk")
# the KL estimator each update uses unless --distill-kl names one: the sampled token's k1 as a
# reward (Thinking Machines' recipe); k2 as a loss, whose gradient on the student's own samples
# is reverse KL's, the same as k1's as a reward (k1's own gradient is zero in expectation)
DEFAULT_KL = {"policy-gradient": "kl", "supervised": "mse"}


@dataclass(frozen=True)
class DistillConfig:
    """The checked distillation flags and the teacher they name."""

    teacher: str  # its checkpoint (a Hugging Face directory converted once)
    model: Any  # its ModelConfig when it is not the student's architecture, else None
    update: str
    estimator: str
    coef: float
    topk: int = 64  # with the topk update: the teacher's tokens per position


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The RL flags with distillation's defaults (one sample per prompt, no KL to a reference,
    no rule reward), then the teacher's."""
    rl_flags.add_arguments(p)
    p.set_defaults(n_samples_per_prompt=1, init_kl_coef=0.0)
    g = p.add_argument_group("On-policy distillation: the teacher")
    a = g.add_argument
    a(
        "--teacher-model",
        default=None,
        help="the teacher: a checkpoint directory, or a Hugging Face causal-LM directory "
        "(converted once), of any size, reading the student's tokens; it runs frozen at the "
        "training layout",
    )
    a(
        "--distill-update",
        choices=UPDATES,
        default="policy-gradient",
        help="policy-gradient: each sampled token's reward is minus its KL estimate to the "
        "teacher (the clipped policy loss on it); supervised: the KL estimate is the loss; "
        "topk: KL(teacher || student) over the teacher's --distill-topk likeliest tokens at "
        "each position is the loss",
    )
    a(
        "--distill-topk",
        type=int,
        default=64,
        help="with --distill-update topk: the teacher's tokens per position",
    )
    a(
        "--distill-kl",
        choices=L.KL_PENALTIES,
        default=None,
        help="the per-token estimate of KL(student || teacher): kl (k1), mse (k2) or "
        "low_var_kl (k3, clamped as the reference's KL penalty is) (default: kl with "
        "policy-gradient, mse with supervised: the same gradient on the student's own samples)",
    )
    a(
        "--distill-coef",
        type=float,
        default=1.0,
        help="the weight of the distillation term (against the rule rewards' advantages)",
    )


expand_config = rl_flags.expand_config


def check_update(args: argparse.Namespace) -> tuple[str, str]:
    """(update, estimator), checked before any file is read."""
    update = args.distill_update
    if update == "topk":
        if args.distill_kl is not None:
            raise UsageError(
                f"--distill-kl {args.distill_kl} with --distill-update topk: the topk update "
                "compares whole distributions over the teacher's top tokens, not a sampled "
                "token's estimate; drop --distill-kl"
            )
        return update, "topk"
    estimator = args.distill_kl or DEFAULT_KL[update]
    if update == "supervised" and estimator == "kl":
        raise UsageError(
            "--distill-update supervised with --distill-kl kl: the gradient of k1 at a sampled "
            "token is zero in expectation; use mse (k2) or low_var_kl (k3), or "
            "--distill-update policy-gradient"
        )
    rewarded = args.verifier_function or args.reward_model or args.process_reward_model
    if rewarded and args.n_samples_per_prompt < 2:
        raise UsageError(
            f"--stage distill with rewards and --n-samples-per-prompt "
            f"{args.n_samples_per_prompt}: a reward's advantage is normalised in its group; "
            "sample 2 or more per prompt"
        )
    if args.adv_estimator == "gae":
        raise UsageError("--adv-estimator gae needs a critic: use --stage ppo")
    return update, estimator
