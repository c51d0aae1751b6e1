"""The stage table: what ``anyspeed pretrain`` and ``anyspeed posttrain --stage S`` train.

A stage is one row: its own flags, its checks (which return the data it opened, its config and
the records its checkpoints carry) and its task. The parse, the generic checks, the launcher,
the engine and the hooks are shared; a new stage adds its folder under ``stages/`` and a row
here (docs/architecture.md says what else: its preprocessing handler, its export).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from anyspeed.errors import UsageError
from anyspeed.stages.flags import POSTTRAIN_STAGES
from anyspeed.training.run import Run
from anyspeed.training.task import Stage, Task


def _with_stage_flags(
    expand: Callable[..., list[str]], name: str
) -> Callable[[list[str]], list[str]]:
    """A stage's ``--rl-config`` reader, given the stage's own flags (a MindSpeed-RL file's
    training sections become those of its keys that are flags of the stage)."""

    def flags() -> dict:
        return dict(build_stage_parser(STAGES[name]())._option_string_actions)

    return lambda argv: expand(argv, flags)


def _pretrain() -> Stage:
    from anyspeed.stages.pretrain import task as pretrain

    return Stage(
        "pretrain",
        "pretrain",
        "next-token prediction on Megatron's GPT datasets",
        (),
        pretrain.plan,
        pretrain.make_task,
    )


def _sft() -> Stage:
    from anyspeed.stages import flags as posttrain_flags
    from anyspeed.stages.sft import task as sft

    return Stage(
        "sft",
        "posttrain",
        "supervised fine-tuning (full or LoRA) on instruction data",
        (posttrain_flags.add_arguments, sft.add_arguments),
        sft.plan,
        sft.make_task,
    )


def _preference(kind: str) -> Callable[[], Stage]:
    def row() -> Stage:
        from anyspeed.stages import flags as posttrain_flags
        from anyspeed.stages.preference import task as preference
        from anyspeed.stages.sft import task as sft

        own = {"dpo": preference.add_dpo_arguments, "simpo": preference.add_simpo_arguments}
        helps = {
            "dpo": "direct preference optimisation against a frozen reference (full or "
            "LoRA) on pairwise data",
            "simpo": "SimPO: reference-free preference optimisation on pairwise data",
        }
        return Stage(
            kind,
            "posttrain",
            helps[kind],
            (
                posttrain_flags.add_arguments,
                sft.add_arguments,
                preference.add_pairwise_arguments,
                own[kind],
            ),
            lambda args: preference.plan(args, kind),
            preference.make_task,
        )

    return row


def _orm() -> Stage:
    from anyspeed.stages import flags as posttrain_flags
    from anyspeed.stages.preference import orm
    from anyspeed.stages.preference import task as preference
    from anyspeed.stages.sft import task as sft

    return Stage(
        "orm",
        "posttrain",
        "an outcome reward model (a scalar head) on pairwise data",
        (posttrain_flags.add_arguments, sft.add_arguments, preference.add_pairwise_arguments),
        orm.plan,
        orm.make_task,
    )


def _prm() -> Stage:
    from anyspeed.stages import flags as posttrain_flags
    from anyspeed.stages.prm import task as prm
    from anyspeed.stages.sft import task as sft

    return Stage(
        "prm",
        "posttrain",
        "a process reward model: each step's label token at its placeholder, on step-labelled data",
        (posttrain_flags.add_arguments, sft.add_arguments, prm.add_arguments),
        prm.plan,
        prm.make_task,
    )


def _grpo() -> Stage:
    from anyspeed.stages import flags as posttrain_flags
    from anyspeed.stages.grpo import stage as grpo

    return Stage(
        "grpo",
        "posttrain",
        "colocated GRPO (DAPO's and GSPO's options) with rule rewards on prompt data",
        (posttrain_flags.add_arguments, grpo.add_arguments),
        grpo.plan,
        grpo.make_task,
        argv=_with_stage_flags(grpo.expand_config, "grpo"),
    )


def _ppo() -> Stage:
    from anyspeed.stages import flags as posttrain_flags
    from anyspeed.stages.ppo import stage as ppo

    return Stage(
        "ppo",
        "posttrain",
        "colocated PPO: a critic (GAE) beside the policy, rule rewards on prompt data",
        (posttrain_flags.add_arguments, ppo.add_arguments),
        ppo.plan,
        ppo.make_task,
        argv=_with_stage_flags(ppo.expand_config, "ppo"),
    )


def _vlm() -> Stage:
    from anyspeed.stages import flags as posttrain_flags
    from anyspeed.stages.vlm import stage as vlm

    return Stage(
        "vlm",
        "posttrain",
        "a vision-language model (LLaVA with a CLIP/SigLIP tower, "
        "or Qwen2-VL / Qwen2.5-VL) on image-text conversations",
        (posttrain_flags.add_arguments, vlm.add_arguments),
        vlm.plan,
        vlm.make_task,
        argv=vlm.expand_argv,
    )


def _vlm_grpo() -> Stage:
    from anyspeed.stages import flags as posttrain_flags
    from anyspeed.stages.vlm import qwen_grpo
    from anyspeed.stages.vlm import stage as vlm

    return Stage(
        "vlm_grpo",
        "posttrain",
        "GRPO on a Qwen2-VL / Qwen2.5-VL model: colocated rollouts from image prompts, rule "
        "rewards against the records' answers",
        (posttrain_flags.add_arguments, vlm.add_arguments, qwen_grpo.add_arguments),
        qwen_grpo.plan,
        qwen_grpo.make_task,
        argv=vlm.expand_argv,
    )


def _distill() -> Stage:
    from anyspeed.stages import flags as posttrain_flags
    from anyspeed.stages.distill import stage as distill

    return Stage(
        "distill",
        "posttrain",
        "on-policy distillation: the student samples, a frozen teacher's log-probabilities "
        "are its signal, on prompt data",
        (posttrain_flags.add_arguments, distill.add_arguments),
        distill.plan,
        distill.make_task,
        argv=_with_stage_flags(distill.expand_config, "distill"),
    )


# name -> row builder (imports stay lazy: `anyspeed --help` must start fast)
STAGES: dict[str, Callable[[], Stage]] = {
    "pretrain": _pretrain,
    "sft": _sft,
    "dpo": _preference("dpo"),
    "simpo": _preference("simpo"),
    "orm": _orm,
    "prm": _prm,
    "grpo": _grpo,
    "ppo": _ppo,
    "distill": _distill,
    "vlm": _vlm,
    "vlm_grpo": _vlm_grpo,
}


def get_stage(name: str | None, command: str = "posttrain") -> Stage:
    """The row for ``name``; a UsageError listing the known stages otherwise."""
    known = POSTTRAIN_STAGES if command == "posttrain" else ("pretrain",)
    if name is None:
        raise UsageError(f"--stage is required ({', '.join(known)})")
    if name not in known:
        raise UsageError(f"--stage {name!r} is unknown; choose one of {', '.join(known)}")
    return STAGES[name]()


def build_stage_parser(stage: Stage) -> argparse.ArgumentParser:
    """The pretraining parser plus the stage's own flags, named for its command."""
    from anyspeed.stages.arguments import build_parser

    p = build_parser()
    p.prog = f"anyspeed {stage.command}"
    if stage.command == "posttrain":  # its usage and help name the stage
        p.prog += f" --stage {stage.name}"
    for add in stage.flags:
        add(p)
    return p


def task_for(run: Run) -> Task:
    """The task of checked ``run``'s stage (what :func:`anyspeed.training.engine.train` runs)."""
    return STAGES[run.stage]().task(run)
