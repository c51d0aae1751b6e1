"""``anyspeed posttrain --stage grpo``: colocated GRPO (and DAPO's options) on Megatron-Core at
the training layout: rollout, old/reference log-probs and the update in the same processes.

This module holds the flags (MindSpeed-RL's config names; ``--rl-config FILE`` may stand in for
them), the checks and the config; the task is :mod:`anyspeed.stages.grpo.task`, the
objective :mod:`anyspeed.stages.grpo.loss`, the rewards
:mod:`anyspeed.stages.grpo.rewards`. Batch sizes: ``--rollout-batch-size`` prompts per
rollout (MindSpeed-RL's ``global_batch_size``), ``--n-samples-per-prompt`` samples each, and
``--global-batch-size`` sequences per optimizer step (MindSpeed-RL's ``mini_batch_size``, also
accepted under that name); ``--ppo-epochs`` passes over each rollout.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from anyspeed.errors import UsageError
from anyspeed.stages.grpo import loss as L
from anyspeed.training.task import StagePlan

# --rl-config keys (MindSpeed-RL's rl_config / generate_config names) -> flags
YAML_KEYS = {
    "n_samples_per_prompt": "--n-samples-per-prompt", "clip_ratio": "--clip-ratio",
    "clip_ratio_high": "--clip-ratio-high", "kl_penalty": "--kl-penalty",
    "init_kl_coef": "--init-kl-coef", "entropy_coeff": "--entropy-coeff",
    "adv_estimator": "--adv-estimator", "mini_batch_size": "--global-batch-size",
    "global_batch_size": "--rollout-batch-size", "max_prompt_length": "--max-prompt-length",
    "max_response_length": "--max-response-length", "temperature": "--temperature",
    "top_p": "--top-p", "top_k": "--top-k", "verifier_function": "--verifier-function",
    "verifier_weight": "--verifier-weight", "epochs": "--ppo-epochs",
    "loss_agg_mode": "--loss-agg-mode", "filter_groups": "--filter-groups",
    "overlong_buffer_len": "--overlong-buffer-len",
    "overlong_penalty_factor": "--overlong-penalty-factor",
    "infer_tensor_parallel_size": "--infer-tensor-parallel-size",
    "infer_pipeline_parallel_size": "--infer-pipeline-parallel-size",
    "infer_expert_parallel_size": "--infer-expert-parallel-size",
}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """GRPO's flags."""
    g = p.add_argument_group("GRPO (MindSpeed-RL's names)")
    a = g.add_argument
    a("--rl-config", default=None, help="a YAML of rl_config/generate_config keys standing in "
      "for flags (flags given win)")  # fmt: skip
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
    a("--infer-tensor-parallel-size", type=int, default=None, help="the rollout's TP size "
      "(default: training's; 1, with the PP and EP sizes 1: the whole model on every rank, "
      "sampling at TP 1 x DP world size, weights moved in memory)")  # fmt: skip
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
        help="group_norm (GRPO) or group_mean (Dr. GRPO: no std)",
    )
    a(
        "--loss-agg-mode",
        choices=L.AGGREGATIONS,
        default="token-mean",
        help="how per-token terms become the loss (token-mean: the global token mean)",
    )
    a(
        "--verifier-function",
        nargs="+",
        default=["gsm8k"],
        help="rule rewards (gsm8k, gsm8k_flexible, boxed, base_acc, answer_tag, format) or "
        "module:function(prompts, completions, labels) -> list[float]",
    )
    a("--verifier-weight", nargs="+", type=float, default=None, help="(default: all 1)")
    a("--overlong-buffer-len", type=int, default=0, help="DAPO's soft overlong penalty")
    a("--overlong-penalty-factor", type=float, default=1.0)
    a(
        "--filter-groups",
        action="store_true",
        help="DAPO's dynamic sampling: groups with equal rewards are replaced",
    )
    a(
        "--max-num-gen-batches",
        type=int,
        default=10,
        help="with --filter-groups: rollouts tried per step at most",
    )
    add_reference_arguments(g)


def expand_config(argv: list[str]) -> list[str]:
    """``--rl-config FILE``'s keys as flags before the command line's own (which win)."""
    from anyspeed.argv import get_flag, merge_flags

    path = get_flag(argv, "--rl-config")
    if path is None:
        return argv
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"--rl-config {path!r}: {exc}".splitlines()[0]) from None
    flat: dict[str, Any] = {}
    for section in (doc, doc.get("rl_config") or {}, doc.get("generate_config") or {},
                    (doc.get("generate_config") or {}).get("sampling_config") or {}):  # fmt: skip
        flat.update({k: v for k, v in section.items() if not isinstance(v, dict)})
    flags: list[str] = []
    for key, value in flat.items():
        if key in YAML_KEYS and value is not None:
            flag = YAML_KEYS[key]
            if isinstance(value, bool):
                flags += [flag] if value else []
            elif isinstance(value, list):
                flags += [flag, *map(str, value)]
            else:
                flags += [flag, str(value)]
    return merge_flags(flags, argv)


@dataclass(frozen=True)
class GRPOConfig:
    """The checked GRPO flags."""

    prefix: str
    group: int
    rollout_batch: int  # prompts per rollout (all ranks)
    epochs: int
    steps_per_rollout: int
    max_prompt: int
    max_response: int
    temperature: float
    top_p: float
    top_k: int
    clip_low: float
    clip_high: float
    kl_penalty: str
    beta: float
    entropy_coeff: float
    adv_estimator: str
    agg: str
    verifiers: tuple[str, ...]
    weights: tuple[float, ...] | None
    overlong_buffer: int
    overlong_factor: float
    filter_groups: bool
    max_gen_batches: int
    rows: Any = None  # the prompt rows short enough to roll out
    reference: str | None = None
    reference_iteration: int | None = None
    lora: Any = None
    reshard: bool = False  # the rollout at TP 1 x DP world size (grpo_reshard.py)


def _data_parallel(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", args.nproc_per_node or 1))
    model = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    return max(1, world // (model * args.context_parallel_size))


def _check_sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """(prompts per rollout, steps per rollout, max prompt length), checked."""
    g, gbs = args.n_samples_per_prompt, args.global_batch_size
    if g < 1 or args.ppo_epochs < 1 or args.max_response_length < 1:
        raise UsageError("--n-samples-per-prompt, --ppo-epochs and --max-response-length "
                         "must be at least 1")  # fmt: skip
    if gbs % g:
        raise UsageError(f"--global-batch-size {gbs} (sequences per step) is not a multiple "
                         f"of --n-samples-per-prompt {g}")  # fmt: skip
    rbs = args.rollout_batch_size or gbs // g
    dp = _data_parallel(args)
    if rbs % dp:
        raise UsageError(f"--rollout-batch-size {rbs} is not a multiple of the data-parallel "
                         f"size {dp}: each replica rolls out its own prompts")  # fmt: skip
    if (rbs * g) % gbs:
        raise UsageError(f"--rollout-batch-size {rbs} x --n-samples-per-prompt {g} sequences "
                         f"do not split into steps of --global-batch-size {gbs}")  # fmt: skip
    steps = args.ppo_epochs * rbs * g // gbs
    if args.save and args.save_interval and args.save_interval % steps:
        raise UsageError(f"--save-interval {args.save_interval}: save at the end of a rollout "
                         f"(a multiple of its {steps} optimizer steps) so that resuming is "
                         "exact")  # fmt: skip
    prompt = args.max_prompt_length or args.seq_length - args.max_response_length
    if prompt < 1 or prompt + args.max_response_length > args.seq_length:
        raise UsageError(
            f"--max-prompt-length {prompt} + --max-response-length "
            f"{args.max_response_length} exceed --seq-length {args.seq_length}"
        )
    return rbs, steps, prompt


def plan(args: argparse.Namespace) -> StagePlan:
    """The GRPO checks (before the generic ones); the prompt data, opened once."""
    from anyspeed.stages.common.instruction_data import one_prefix
    from anyspeed.stages.common.reference import reference
    from anyspeed.stages.common.values import check_range
    from anyspeed.stages.grpo import data as prompt_data
    from anyspeed.stages.grpo import rewards
    from anyspeed.training import lora

    prefix = one_prefix(args, "prompt")
    if args.context_parallel_size > 1:
        raise UsageError("--stage grpo with --context-parallel-size > 1 is not supported (the "
                         "rollout decodes at CP 1); use CP 1")  # fmt: skip
    if args.tokenizer_name_or_path is None:
        raise UsageError("--stage grpo decodes its samples for the rewards: pass "
                         "--tokenizer-name-or-path (or --load an HF directory)")  # fmt: skip
    rbs, steps, prompt = _check_sizes(args)
    reshard = _rollout_layout(args)
    check_range("--clip-ratio", args.clip_ratio)
    high = args.clip_ratio if args.clip_ratio_high is None else args.clip_ratio_high
    if high < 0 or args.init_kl_coef < 0 or not 0 < args.temperature:
        raise UsageError("--clip-ratio-high and --init-kl-coef must be >= 0, --temperature > 0")
    rewards.resolve(args.verifier_function, args.verifier_weight)  # imports user functions now
    _warn_dropout(args)
    lora_cfg = lora.from_args(args)
    prompt_data.check_files(prefix)
    data = prompt_data.open_prompts(prefix)
    rows = prompt_data.usable_rows(data, prefix, prompt, args.split)
    ref, ref_iter = (None, None) if args.init_kl_coef == 0 else reference(args, lora_cfg, "grpo")
    cfg = GRPOConfig(
        prefix, args.n_samples_per_prompt, rbs, args.ppo_epochs, steps, prompt,
        args.max_response_length, args.temperature, args.top_p, max(args.top_k, 0),
        args.clip_ratio, high, args.kl_penalty, args.init_kl_coef, args.entropy_coeff,
        args.adv_estimator, args.loss_agg_mode, tuple(args.verifier_function),
        tuple(args.verifier_weight) if args.verifier_weight else None,
        args.overlong_buffer_len, args.overlong_penalty_factor, args.filter_groups,
        args.max_num_gen_batches, rows=np.asarray(rows), reference=ref,
        reference_iteration=ref_iter, lora=lora_cfg, reshard=reshard,
    )  # fmt: skip
    records = lora_cfg.record().to_common() if lora_cfg else {}
    return StagePlan([prompt_data.file_prefix(prefix, "input_ids")], cfg, data, records)


def _rollout_layout(args: argparse.Namespace) -> bool:
    """Whether the rollout runs at another layout than training (TP 1 x DP world), checked."""
    train = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
             args.expert_model_parallel_size)  # fmt: skip
    given = (args.infer_tensor_parallel_size, args.infer_pipeline_parallel_size,
             args.infer_expert_parallel_size)  # fmt: skip
    infer = tuple(t if g is None else g for t, g in zip(train, given, strict=True))
    if infer == train:
        return False
    flags = (
        "--infer-tensor-parallel-size, --infer-pipeline-parallel-size, --infer-expert-parallel-size"
    )
    if infer != (1, 1, 1):
        raise UsageError(f"{flags} {' '.join(map(str, infer))}: a rollout layout other than "
                         "training's must be 1, 1, 1 (the whole model on every rank); leave "
                         "them unset to roll out at the training layout")  # fmt: skip
    overlap = getattr(args, "overlap_param_gather", False)
    grouped = getattr(args, "moe_grouped_gemm", False)
    for bad, what in ((grouped, "--moe-grouped-gemm"), (overlap, "--overlap-param-gather")):
        if bad:
            raise UsageError(f"a rollout layout of its own ({flags} 1) with {what} is not "
                             "supported yet; roll out at the training layout")  # fmt: skip
    return True


def _warn_dropout(args: argparse.Namespace) -> None:
    from anyspeed.launch import reports_here

    if (args.hidden_dropout or args.attention_dropout) and reports_here():
        import sys

        print("anyspeed posttrain: warning: --hidden-dropout/--attention-dropout > 0: the "
              "update's forward is random, so its ratio to the old policy (and its KL to the "
              "reference) is not 1 (0) before an update; RL usually sets both to 0",
              file=sys.stderr)  # fmt: skip


def make_task(run: Any) -> Any:
    """The GRPO task of a checked run."""
    from anyspeed.stages.common.reference import hf_vocab
    from anyspeed.stages.grpo.task import GRPOTask

    cfg = run.config
    return GRPOTask(cfg, run, hf_vocab(cfg.reference or run.load))
