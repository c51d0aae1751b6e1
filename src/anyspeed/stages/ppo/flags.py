"""``--stage ppo``'s flags: the RL stages' shared ones (rollout, objective, rewards, reference,
rollout correction) and the critic's, by verl's and MindSpeed-RL's names."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from anyspeed.errors import UsageError
from anyspeed.stages.common.rl import flags as rl_flags


@dataclass(frozen=True)
class CriticConfig:
    """The checked critic flags."""

    gamma: float
    lam: float
    lr: float
    cliprange_value: float
    warmup: int
    load: str | None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The RL flags with PPO's defaults (GAE, one sample per prompt, dual clip 3), then the
    critic's."""
    rl_flags.add_arguments(p)
    p.set_defaults(adv_estimator="gae", n_samples_per_prompt=1)
    g = p.add_argument_group("PPO: the critic (verl's names)")
    a = g.add_argument
    a("--gamma", type=float, default=1.0, help="GAE's discount")
    a("--lam", type=float, default=1.0, help="GAE's lambda")
    a(
        "--critic-load",
        default=None,
        help="the critic's start: an --stage orm (reward model) or critic checkpoint; default: "
        "the policy's --load with a new value head",
    )
    a("--critic-lr", type=float, default=None, help="the critic's learning rate (default --lr)")
    a("--cliprange-value", type=float, default=0.5, help="the value clip around the old values")
    a(
        "--critic-warmup",
        type=int,
        default=0,
        help="rollouts that train only the critic before the policy's first step",
    )
    a(
        "--clip-ratio-c",
        type=float,
        default=3.0,
        help="dual-clip PPO's bound on a negative advantage's ratio (0: off)",
    )
    a(
        "--use-kl-in-reward",
        action="store_true",
        help="the KL penalty (--init-kl-coef) in the token rewards instead of the loss",
    )


expand_config = rl_flags.expand_config


def critic_config(args: argparse.Namespace) -> CriticConfig:
    """The critic's flags, checked (their ranges are in the stage table's)."""
    if args.adv_estimator != "gae":
        raise UsageError(
            f"--stage ppo with --adv-estimator {args.adv_estimator}: PPO's advantages are its "
            "critic's (gae); use --stage grpo for group advantages"
        )
    if args.clip_ratio_c and args.clip_ratio_c <= 1:
        raise UsageError(f"--clip-ratio-c {args.clip_ratio_c:g} must be above 1 (or 0: off)")
    lr = args.lr if args.critic_lr is None else args.critic_lr
    load = args.critic_load
    if load is not None:  # a reward model or an earlier critic; checked as --load is
        from anyspeed.stages.common.value_head import check_model_dir

        load = check_model_dir(args, load, "--critic-load", head=False)
    return CriticConfig(args.gamma, args.lam, lr, args.cliprange_value, args.critic_warmup, load)
