"""The flags of the colocated RL stages (``--stage grpo``, ``ppo``): rollout, old/reference
log-probs and the update in the same processes, on Megatron-Core at the training layout.

MindSpeed-RL's config names; ``--rl-config FILE`` may stand in for them. The checks and the
config are :mod:`.plan`, the task :mod:`.task`, the objective :mod:`.objective`, the rewards
:mod:`.rewards`. Batch sizes: ``--rollout-batch-size`` prompts per
rollout (MindSpeed-RL's ``global_batch_size``), ``--n-samples-per-prompt`` samples each, and
``--global-batch-size`` sequences per optimizer step (MindSpeed-RL's ``mini_batch_size``, also
accepted under that name); ``--ppo-epochs`` passes over each rollout.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from anyspeed.errors import UsageError
from anyspeed.stages.common.rl import correction, multiturn, packing, partial
from anyspeed.stages.common.rl import objective as L

# --rl-config keys (MindSpeed-RL's rl_config / generate_config names) -> flags
YAML_KEYS = {
    "n_samples_per_prompt": "--n-samples-per-prompt",
    "clip_ratio": "--clip-ratio",
    "clip_ratio_high": "--clip-ratio-high",
    "kl_penalty": "--kl-penalty",
    "init_kl_coef": "--init-kl-coef",
    "entropy_coeff": "--entropy-coeff",
    "adv_estimator": "--adv-estimator",
    "mini_batch_size": "--global-batch-size",
    "global_batch_size": "--rollout-batch-size",
    "max_prompt_length": "--max-prompt-length",
    "max_response_length": "--max-response-length",
    "max_tokens": "--max-response-length",  # MindSpeed-RL's sampling_config
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "verifier_function": "--verifier-function",
    "verifier_weight": "--verifier-weight",
    "reward_model": "--reward-model",
    "reward_model_weight": "--reward-model-weight",
    "reward_tensor_parallel_size": "--reward-tensor-parallel-size",
    "reward_pipeline_parallel_size": "--reward-pipeline-parallel-size",
    "process_reward_model": "--process-reward-model",
    "prm_weight": "--prm-weight",
    "prm_aggregate": "--prm-aggregate",
    "epochs": "--ppo-epochs",
    "loss_agg_mode": "--loss-agg-mode",
    "importance_sampling_level": "--importance-sampling-level",
    "rollout_is": "--rollout-is",
    "rollout_is_threshold": "--rollout-is-threshold",
    "rollout_rs": "--rollout-rs",
    "rollout_rs_threshold": "--rollout-rs-threshold",
    "rollout_rs_threshold_lower": "--rollout-rs-threshold-lower",
    "filter_groups": "--filter-groups",
    "overlong_buffer_len": "--overlong-buffer-len",
    "overlong_penalty_factor": "--overlong-penalty-factor",
    "infer_tensor_parallel_size": "--infer-tensor-parallel-size",
    "infer_pipeline_parallel_size": "--infer-pipeline-parallel-size",
    "infer_expert_parallel_size": "--infer-expert-parallel-size",
    "tools": "--tools",
    "max_tool_calls": "--max-tool-calls",
    "max_tool_response_length": "--max-tool-response-length",
    "tool_response_truncate_side": "--tool-response-truncate-side",
    "tool_timeout": "--tool-timeout",
    "tool_parser_format": "--tool-parser-format",
    "use_remove_padding": "--use-remove-padding",
    "use_dynamic_bsz": "--use-dynamic-bsz",
    "max_packing_token_size": "--max-packing-token-size",
    "partial_rollout_max_split": "--partial-rollout-max-split",
    "gamma": "--gamma",
    "lam": "--lam",
    "use_kl_in_reward": "--use-kl-in-reward",
    "cliprange_value": "--cliprange-value",
    "no_shuffle": "--no-shuffle",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The RL stages' shared flags. They evaluate nothing (no held-out loss): ``--eval-iters``
    defaults to 0, so a ``--split`` share that gets no prompt is not refused."""
    p.set_defaults(eval_iters=0)
    g = p.add_argument_group("RL: GRPO, PPO (MindSpeed-RL's names)")
    a = g.add_argument
    a(
        "--rl-config",
        default=None,
        help="a YAML of rl_config/generate_config keys standing in for flags (flags given win)",
    )
    a(
        "--prompt-type",
        default=None,
        help="the chat template the prompts were preprocessed with (checked)",
    )
    a("--n-samples-per-prompt", type=int, default=8, help="samples per prompt (the group)")
    a(
        "--rollout-batch-size",
        type=int,
        default=None,
        help="prompts per rollout (default: --global-batch-size / --n-samples-per-prompt)",
    )
    a(
        "--mini-batch-size",
        dest="global_batch_size",
        type=int,
        default=argparse.SUPPRESS,
        help="MindSpeed-RL's name of --global-batch-size: sequences per optimizer step",
    )
    a("--ppo-epochs", type=int, default=1, help="optimizer passes over each rollout (mu)")
    a(
        "--max-prompt-length",
        type=int,
        default=None,
        help="longer prompts are left out (default: --seq-length - --max-response-length)",
    )
    a("--max-response-length", type=int, default=128, help="new tokens per sample at most")
    a("--temperature", type=float, default=1.0)
    a("--top-p", type=float, default=1.0)
    a("--top-k", type=int, default=0, help="0 or -1: no top-k cut")
    a(
        "--infer-tensor-parallel-size",
        type=int,
        default=None,
        help="the rollout's TP size "
        "(default: training's; 1, with the PP and EP sizes 1: the whole model on every rank, "
        "sampling at TP 1 x DP world size, weights moved in memory)",
    )
    a(
        "--infer-pipeline-parallel-size",
        type=int,
        default=None,
        help="the rollout's PP size (default: training's; see --infer-tensor-parallel-size)",
    )
    a(
        "--infer-expert-parallel-size",
        type=int,
        default=None,
        help="the rollout's EP size (default: training's; see --infer-tensor-parallel-size)",
    )
    packing.add_arguments(g)
    partial.add_arguments(g)
    _add_objective(g)


def _add_objective(g: Any) -> None:
    """The objective's and the rewards' flags."""
    from anyspeed.stages.common.reference import add_reference_arguments

    a = g.add_argument
    a("--clip-ratio", type=float, default=0.2, help="epsilon of the ratio clip")
    a(
        "--clip-ratio-high",
        type=float,
        default=None,
        help="DAPO's upper epsilon (default: --clip-ratio)",
    )
    a(
        "--kl-penalty",
        choices=L.KL_PENALTIES,
        default="low_var_kl",
        help="low_var_kl (k3), kl (k1) or mse (k2)",
    )
    a(
        "--init-kl-coef",
        type=float,
        default=0.001,
        help="beta of the KL penalty; 0 builds no reference",
    )
    a("--entropy-coeff", type=float, default=0.0, help="weight of the entropy bonus")
    a(
        "--adv-estimator",
        choices=L.ADVANTAGES,
        default="group_norm",
        help="group_norm (GRPO), group_mean (Dr. GRPO: no std) or gae (PPO: a critic's)",
    )
    a(
        "--importance-sampling-level",
        choices=L.IS_LEVELS,
        default="token",
        help="the ratio the clip acts on (TRL's name): token (GRPO), sequence (GSPO: the "
        "sequence's geometric-mean ratio; its paper clips at --clip-ratio 3e-4 "
        "--clip-ratio-high 4e-4) or sequence_token (GSPO-token: that value, per-token gradients)",
    )
    a(
        "--loss-agg-mode",
        choices=L.AGGREGATIONS,
        default="token-mean",
        help="how per-token terms become the loss (token-mean: the global token mean)",
    )
    _add_rewards(a)
    a("--overlong-buffer-len", type=int, default=0, help="DAPO's soft overlong penalty")
    a("--overlong-penalty-factor", type=float, default=1.0)
    a(
        "--filter-groups",
        action="store_true",
        help="DAPO's dynamic sampling: groups with equal rewards are replaced",
    )
    a(
        "--no-shuffle",
        action="store_true",
        help="prompts in file order, epoch after epoch (MindSpeed-RL's no_shuffle)",
    )
    a(
        "--max-num-gen-batches",
        type=int,
        default=10,
        help="with --filter-groups: rollouts tried per step at most",
    )
    add_reference_arguments(g)
    correction.add_arguments(g)
    multiturn.add_arguments(g)


def _add_rewards(a: Any) -> None:
    """The rewards' flags: rule functions and a reward model (its weight and layout)."""
    a(
        "--verifier-function",
        nargs="+",
        default=None,
        help="rule rewards (gsm8k, gsm8k_flexible, boxed, base_acc, answer_tag, format) or "
        "module:function(prompts, completions, labels) -> list[float] (default: gsm8k, or "
        "none with --reward-model)",
    )
    a("--verifier-weight", nargs="+", type=float, default=None, help="(default: all 1)")
    a(
        "--reward-model",
        default=None,
        help="an --stage orm checkpoint (or a one-label *ForSequenceClassification HF "
        "directory) reading the policy's tokens, of any size: its score of each sample at its "
        "last token is a reward (added to the rule rewards)",
    )
    a("--reward-model-weight", type=float, default=1.0, help="the reward model score's weight")
    a(
        "--reward-tensor-parallel-size",
        type=int,
        default=None,
        help="the reward model's TP size (default: training's; 1, with its PP size 1: the "
        "whole reward model on every rank, in groups of its own)",
    )
    a(
        "--reward-pipeline-parallel-size",
        type=int,
        default=None,
        help="the reward model's PP size (default: training's; see --reward-tensor-parallel-size)",
    )
    _add_process_reward(a)


def _add_process_reward(a: Any) -> None:
    """A process reward model's flags (:mod:`.process_reward`)."""
    from anyspeed.stages.common.rl.process_reward import AGGREGATES

    a(
        "--process-reward-model",
        default=None,
        help="an --stage prm checkpoint (or an HF *ForCausalLM PRM) reading the policy's "
        "tokens: it scores each step of a sample; the steps' score is a reward",
    )
    a("--prm-weight", type=float, default=1.0, help="the process reward's weight")
    a(
        "--prm-aggregate",
        choices=AGGREGATES,
        default="min",
        help="a sample's score from its steps' (default: min, the weakest step)",
    )
    a("--prm-step-separator", default="\n", help="where an answer's steps end (default: \\n)")
    a(
        "--prm-step-rewards",
        action="store_true",
        help="PPO: each step's score (times --prm-weight) is a token reward at the step's last "
        "token, for GAE, instead of the steps' combined score as the answer's reward",
    )
    a(
        "--prm-placeholder-token",
        default=None,
        help="the token after each step (default: the PRM checkpoint's, else ки)",
    )
    a(
        "--prm-reward-tokens",
        nargs="+",
        default=None,
        help="the label tokens, the good one first (default: the PRM checkpoint's, else + -)",
    )


def expand_config(
    argv: list[str], stage_flags: Callable[[], dict[str, Any]] | None = None
) -> list[str]:
    """``--rl-config FILE``'s keys as flags before the command line's own (which win): its
    ``rl_config`` / ``generate_config`` keys and, given the stage's flags (``stage_flags()``:
    flag -> argparse action), a MindSpeed-RL file's model, training and actor sections
    (:mod:`~anyspeed.stages.common.rl.mindspeed_config`). Keys no flag of the stage reads are
    named in one warning line."""
    from anyspeed.argv import get_flag, merge_flags
    from anyspeed.stages.common.rl import mindspeed_config

    path = get_flag(argv, "--rl-config")
    if path is None:
        return argv
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"--rl-config {path!r}: {exc}".splitlines()[0]) from None
    actions = stage_flags() if stage_flags is not None else None
    found, unread = _yaml_values(doc, path)
    flags, more = (
        mindspeed_config.training_flags(doc, path, actions, YAML_KEYS) if actions else ([], [])
    )
    dapo, used, not_honoured = mindspeed_config.dapo_flags(doc)
    unread = [u for u in unread if u.removeprefix("rl_config.") not in used] + not_honoured
    for where, key, value in found:
        if where == "rl_config." and key in used:
            continue
        flag = YAML_KEYS[key]
        if actions is not None and flag not in actions:  # another stage's (PPO's gamma)
            unread.append(where + key)
        elif isinstance(value, bool):
            flags += [flag] if value else []
        elif isinstance(value, list) and flag in LIST_FLAGS:
            flags += [flag, *map(str, value)]
        elif isinstance(value, list | dict):
            raise UsageError(f"--rl-config {path!r}: {where}{key} takes one value, not {value!r}")
        else:
            flags += [flag, str(value)]
    if unread or more:
        _warn_unread(path, unread + more)
    return merge_flags([*flags, *dapo], argv)


# MindSpeed-RL's sections anyspeed reads (the rest of such a file configures other workers)
SECTIONS = ("rl_config", "generate_config", "generate_config.sampling_config")
LIST_FLAGS = ("--verifier-function", "--verifier-weight", "--tools")


def _yaml_values(doc: Any, path: str) -> tuple[list[tuple[str, str, Any]], list[str]]:
    """((section prefix, key, value) of every key anyspeed reads in an ``--rl-config``
    document (its top level and :data:`SECTIONS`), the keys there it does not read);
    UsageError naming the file for a document or section that is not a mapping."""
    if not isinstance(doc, dict):
        raise UsageError(
            f"--rl-config {path!r}: the file must be a YAML mapping (key: value lines), "
            f"not a {type(doc).__name__}"
        )
    found, unread = [], []
    for name in ("", *SECTIONS):
        section: Any = doc
        for part in name.split(".") if name else ():
            section = section.get(part) if isinstance(section, dict) else None
        if section is None:
            continue
        if not isinstance(section, dict):
            raise UsageError(f"--rl-config {path!r}: {name} must be a mapping, not {section!r}")
        where = f"{name}." if name else ""
        for key, value in section.items():
            if key in YAML_KEYS and value is not None:
                found.append((where, key, value))
            elif not isinstance(value, dict) and key not in (*YAML_KEYS, "defaults"):
                unread.append(where + str(key))
    return found, unread


def _warn_unread(path: str, unread: list[str]) -> None:
    from anyspeed.launch import reports_here

    if reports_here():
        import sys

        print(
            f"anyspeed posttrain: warning: --rl-config {path!r}: not read: "
            f"{', '.join(unread)} (anyspeed reads the keys that are flags of the stage; "
            "docs/rl.md lists them)",
            file=sys.stderr,
        )
