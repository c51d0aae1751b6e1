"""The RL stages' checks before start and their config (``--stage grpo``, ``ppo``): batch sizes
against the data-parallel size, the rollout layout, the reference, the rewards, rollout
correction and the prompt data (the flags: :mod:`.flags`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from anyspeed.errors import UsageError
from anyspeed.training.task import StagePlan

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class RLConfig:
    """The checked flags of an RL stage."""

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
    reshard: bool = False  # the rollout at TP 1 x DP world size (rollout_model.py)
    is_level: str = "token"  # the ratio's level (GSPO: sequence)
    correction: Any = None  # rollout correction (correction.Correction), None: off
    extra: Any = None  # the stage's own config (PPO: the critic's)
    dual_clip: float | None = None  # dual-clip PPO's c (None: off)
    kl_in_reward: bool = False  # the KL penalty in the reward (PPO), not in the loss
    reward_model: str | None = None  # an --stage orm checkpoint scoring each sample
    reward_model_weight: float = 1.0
    process_reward: Any = None  # process_reward.PRMSource: a PRM scoring each sample's steps
    tools: Any = None  # multi-turn rollouts with tool calls (multiturn.ToolConfig), None: off
    packing: Any = None  # remove-padding / dynamic batch size (packing.Packing), None: padded
    partial: Any = None  # partial rollout (partial.PartialConfig), None: each rollout whole


def _data_parallel(args: argparse.Namespace) -> int:
    from anyspeed.distributed.process import planned_world_size

    world = planned_world_size(args.nproc_per_node)
    model = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    return max(1, world // (model * args.context_parallel_size))


def _check_sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """(prompts per rollout, steps per rollout, max prompt length), checked."""
    g, gbs = args.n_samples_per_prompt, args.global_batch_size
    if g < 1 or args.ppo_epochs < 1 or args.max_response_length < 1:
        raise UsageError(
            "--n-samples-per-prompt, --ppo-epochs and --max-response-length must be at least 1"
        )
    if gbs % g:
        raise UsageError(
            f"--global-batch-size {gbs} (sequences per step) is not a multiple "
            f"of --n-samples-per-prompt {g}"
        )
    rbs = args.rollout_batch_size or gbs // g
    dp = _data_parallel(args)
    if rbs % dp:
        raise UsageError(
            f"--rollout-batch-size {rbs} is not a multiple of the data-parallel "
            f"size {dp}: each replica rolls out its own prompts"
        )
    if (rbs * g) % gbs:
        raise UsageError(
            f"--rollout-batch-size {rbs} x --n-samples-per-prompt {g} sequences "
            f"do not split into steps of --global-batch-size {gbs}"
        )
    steps = args.ppo_epochs * rbs * g // gbs
    if args.save and args.save_interval and args.save_interval % steps:
        raise UsageError(
            f"--save-interval {args.save_interval}: save at the end of a rollout "
            f"(a multiple of its {steps} optimizer steps) so that resuming is "
            "exact"
        )
    prompt = args.max_prompt_length or args.seq_length - args.max_response_length
    if prompt < 1 or prompt + args.max_response_length > args.seq_length:
        raise UsageError(
            f"--max-prompt-length {prompt} + --max-response-length "
            f"{args.max_response_length} exceed --seq-length {args.seq_length}"
        )
    return rbs, steps, prompt


def _check_decoding(args: argparse.Namespace) -> None:
    """What the rollout's decoding needs: CP 1 and a tokenizer."""
    if args.context_parallel_size > 1:
        raise UsageError(
            f"--stage {args.stage} with --context-parallel-size > 1 is not supported (the "
            "rollout decodes at CP 1); use CP 1"
        )
    if args.tokenizer_name_or_path is None:
        raise UsageError(
            f"--stage {args.stage} decodes its samples for the rewards: pass "
            "--tokenizer-name-or-path (or --load an HF directory)"
        )


def rl_plan(
    args: argparse.Namespace,
    extra: Any = None,
    verifiers: tuple[str, ...] = ("gsm8k",),
    **fields: Any,
) -> StagePlan:
    """An RL stage's checks (before the generic ones); the prompt data, opened once. ``extra``:
    the stage's own checked config (PPO's critic); ``verifiers``: the rule rewards when none is
    named and no reward model scores; ``fields``: :class:`RLConfig` fields the stage sets."""
    from anyspeed.stages.common.instruction_data import one_prefix
    from anyspeed.stages.common.reference import reference
    from anyspeed.stages.common.rl import correction, multiturn, packing, partial
    from anyspeed.stages.common.rl import prompts as prompt_data
    from anyspeed.training import lora

    prefix = one_prefix(args, "prompt")
    _check_decoding(args)
    rbs, steps, prompt = _check_sizes(args)
    packed = packing.from_args(args)
    reshard = _rollout_layout(args)
    high = args.clip_ratio if args.clip_ratio_high is None else args.clip_ratio_high
    rm, prm, named = _rewards(args, verifiers)
    _warn_dropout(args)
    lora_cfg = lora.from_args(args)
    prompt_data.check_files(prefix)
    data = prompt_data.open_prompts(prefix)
    rows = prompt_data.usable_rows(data, prefix, prompt, args.split)
    ref, ref_iter = (
        (None, None) if args.init_kl_coef == 0 else reference(args, lora_cfg, args.stage)
    )
    cfg = RLConfig(
        prefix,
        args.n_samples_per_prompt,
        rbs,
        args.ppo_epochs,
        steps,
        prompt,
        args.max_response_length,
        args.temperature,
        args.top_p,
        max(args.top_k, 0),
        args.clip_ratio,
        high,
        args.kl_penalty,
        args.init_kl_coef,
        args.entropy_coeff,
        args.adv_estimator,
        args.loss_agg_mode,
        tuple(named),
        tuple(args.verifier_weight) if args.verifier_weight else None,
        args.overlong_buffer_len,
        args.overlong_penalty_factor,
        args.filter_groups,
        args.max_num_gen_batches,
        rows=np.asarray(rows),
        reference=ref,
        reference_iteration=ref_iter,
        lora=lora_cfg,
        reshard=reshard,
        is_level=_is_level(args),
        correction=correction.from_args(args),
        extra=extra,
        reward_model=rm,
        reward_model_weight=args.reward_model_weight,
        process_reward=prm,
        tools=multiturn.from_args(args),
        packing=packed,
        partial=partial.from_args(args),
        **fields,
    )
    records = lora_cfg.record().to_common() if lora_cfg else {}
    return StagePlan([prompt_data.file_prefix(prefix, "input_ids")], cfg, data, records)


def _rewards(args: argparse.Namespace, verifiers: tuple[str, ...]) -> tuple[Any, Any, list[str]]:
    """(reward model, process reward model, rule rewards), checked; the rule rewards default
    to ``verifiers`` when no model scores (user functions are imported now)."""
    from anyspeed.stages.common.rl import process_reward, reward_model, rewards

    rm = reward_model.check(args)
    prm = process_reward.check(args)
    named = args.verifier_function or ([] if rm or prm else list(verifiers))
    if named:
        rewards.resolve(named, args.verifier_weight)
    return rm, prm, named


def _is_level(args: argparse.Namespace) -> str:
    """``--importance-sampling-level``, checked: a sequence ratio is one value per sequence,
    so (as TRL and the GSPO paper have it) each sequence weighs the same in the loss."""
    level = args.importance_sampling_level
    if level == "sequence" and args.loss_agg_mode != "seq-mean-token-mean":
        raise UsageError(
            f"--importance-sampling-level sequence (GSPO) with --loss-agg-mode "
            f"{args.loss_agg_mode}: GSPO averages per sequence; use --loss-agg-mode "
            "seq-mean-token-mean, or sequence_token for a per-token aggregation"
        )
    return level


def _rollout_layout(args: argparse.Namespace) -> bool:
    """Whether the rollout runs at another layout than training (TP 1 x DP world), checked."""
    train = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.expert_model_parallel_size,
    )
    given = (
        args.infer_tensor_parallel_size,
        args.infer_pipeline_parallel_size,
        args.infer_expert_parallel_size,
    )
    infer = tuple(t if g is None else g for t, g in zip(train, given, strict=True))
    if infer == train:
        return False
    flags = (
        "--infer-tensor-parallel-size, --infer-pipeline-parallel-size, --infer-expert-parallel-size"
    )
    if infer != (1, 1, 1):
        raise UsageError(
            f"{flags} {' '.join(map(str, infer))}: a rollout layout other than "
            "training's must be 1, 1, 1 (the whole model on every rank); leave "
            "them unset to roll out at the training layout"
        )
    overlap = getattr(args, "overlap_param_gather", False)
    grouped = getattr(args, "moe_grouped_gemm", False)
    for bad, what in ((grouped, "--moe-grouped-gemm"), (overlap, "--overlap-param-gather")):
        if bad:
            raise UsageError(
                f"a rollout layout of its own ({flags} 1) with {what} is not "
                "supported yet; roll out at the training layout"
            )
    return True


def _warn_dropout(args: argparse.Namespace) -> None:
    from anyspeed.launch import reports_here

    if (args.hidden_dropout or args.attention_dropout) and reports_here():
        import sys

        print(
            "anyspeed posttrain: warning: --hidden-dropout/--attention-dropout > 0: the "
            "update's forward is random, so its ratio to the old policy (and its KL to the "
            "reference) is not 1 (0) before an update; RL usually sets both to 0",
            file=sys.stderr,
        )
