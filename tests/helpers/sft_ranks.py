"""``anyspeed posttrain`` runs inside spawned ranks (importable by name for spawn)."""

from __future__ import annotations


def posttrain(cli: list[str]) -> dict:
    """Run ``anyspeed posttrain`` with ``cli`` in this rank; its history (no trainer)."""
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train

    args, _ = prepare(cli, command="posttrain")
    history = train(args, task_for(args))
    history.pop("trainer")
    return history


def posttrain_many(clis: list[list[str]]) -> list[dict]:
    """:func:`posttrain` for each command line in turn in one process group; the adaptor is
    re-applied with each case's flags (context parallelism is a feature)."""
    from anyspeed import adaptor

    out = []
    for cli in clis:
        adaptor.undo()
        adaptor.apply(argv=cli)
        out.append(posttrain(cli))
    return out


def overfit(cli: list[str], prefix: str) -> dict:
    """Train, then greedily decode every sample's prompt for as many tokens as its response."""
    from anyspeed.inference.generate import generate_ids
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train
    from helpers.corpora import read_back

    args, _ = prepare(cli, command="posttrain")
    history = train(args, task_for(args))
    model = history.pop("trainer").model
    pairs = []
    ids = read_back(f"{prefix}_packed_input_ids_document")
    labels = read_back(f"{prefix}_packed_labels_document")
    for i, lab in zip(ids, labels, strict=True):
        start = next(k for k, v in enumerate(lab) if v != -100)
        out = generate_ids(model, i[:start], len(i) - start, args.seq_length)
        pairs.append((out, i[start:]))  # generate_ids returns the new tokens
    return {"loss": history["loss"], "pairs": pairs}


def reference_costs(cli: list[str]) -> dict:
    """Train (DPO), then what the frozen reference holds: parameters needing gradients, with
    a gradient (or Megatron's main_grad), or known to the optimizer."""
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train

    run, _ = prepare(cli, command="posttrain")
    trainer = train(run, task_for(run)).pop("trainer")
    ref = [p for c in trainer.frozen["reference"].chunks for p in c.parameters()]
    policy = [p for c in trainer.model for p in c.parameters()]
    in_opt = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    return {
        "ref_numel": sum(p.numel() for p in ref),
        "policy_numel": sum(p.numel() for p in policy),
        "requires_grad": sum(p.requires_grad for p in ref),
        "with_grad": sum(p.grad is not None or hasattr(p, "main_grad") for p in ref),
        "in_optimizer": sum(id(p) in in_opt for p in ref),
        "policy_in_optimizer": sum(id(p) in in_opt for p in policy),
    }


def reward_model_scores(cli: list[str], prompts: list[list[int]], answers: list[list[int]]):
    """The run's frozen ``--reward-model`` scores of (prompt, answer) token sequences, through
    the rollout's own path (the task scorer's ``reward_model_scores``, which closes each answer as
    the template closes a turn: here no template, so as given)."""
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import _start

    run, _ = prepare(cli, command="posttrain")
    task = task_for(run)
    trainer, _, _ = _start(run, task)
    return task.scorer.reward_model_scores(trainer, prompts, answers, run.args)


def critic_held(cli: list[str]) -> dict:
    """The bytes the PPO run's critic holds on this rank, counted from its tensors, and what
    ``anyspeed memory --critic`` estimates for it."""
    from anyspeed.commands.memory import options
    from anyspeed.models.memory import critic_bytes
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import train
    from helpers.memory_ranks import held_bytes

    run, _ = prepare(cli, command="posttrain")
    task = task_for(run)
    dp = train(run, task)["trainer"].dp  # the critic has stepped: its optimizer state exists
    held = held_bytes(task.critic.trainer)
    o = options(run.args, dp)
    world = dp * run.layout.tp * run.layout.pp
    return dict(held, estimate=critic_bytes(run.model, run.layout, world, o, held["stage"]))


def tool_trajectories(cli: list[str], rows: list[int]) -> dict:
    """The run's rollout of prompt ``rows`` (one sample each, through the task's own
    ``sample_once``): every sample's prompt, answer tokens, model-token mask, rollout
    log-probs, rewards, and this replica's tool counts."""
    from anyspeed.stages.common.rl.multiturn import ToolStats
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import _start

    run, _ = prepare(cli, command="posttrain")
    task = task_for(run)
    trainer, _, _ = _start(run, task)
    task.tool_stats = ToolStats()
    roll = task.sample_once(trainer, run.data, rows, [(0, r) for r in rows], run.args)
    return {"prompts": roll.prompts, "tokens": roll.tokens, "masks": roll.masks,
            "logps": roll.logps, "rewards": roll.rewards.tolist(),
            "calls": task.tool_stats.calls, "resumed": task.tool_stats.resumed}  # fmt: skip


def distill_rollout(cli: list[str], rows: list[int]) -> list[dict] | None:
    """The run's rollout of prompt ``rows`` through the task's own ``rollout`` (sampled, the
    old and the teacher's log-probs, the advantages): per micro-batch its tokens, labels, loss
    mask, log-probs and advantages, as lists; None off the last pipeline stage."""
    import numpy as np

    from anyspeed.device import torch_device
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import _start

    run, _ = prepare(cli, command="posttrain")
    task = task_for(run)
    trainer, _, _ = _start(run, task)
    micro = task.rollout(trainer, run.data, np.asarray(rows), range(len(rows)), run.args,
                         torch_device())  # fmt: skip
    if "teacher_logp" not in micro[0]:
        return None
    keys = (
        "tokens",
        "labels",
        "loss_mask",
        "old_logp",
        "teacher_logp",
        "advantages",
        "scores",
        "teacher_ids",
        "teacher_top_logp",
    )
    return [{k: b[k].cpu().tolist() for k in keys if k in b} for b in micro]


def teacher_held(cli: list[str], teacher_dir: str) -> dict:
    """The bytes the run's frozen teacher holds on this rank, counted from its tensors, and
    what ``anyspeed memory --teacher-model teacher_dir`` estimates for them."""
    from megatron.core import parallel_state as ps

    from anyspeed.commands.memory import _frozen_model
    from anyspeed.models.memory import frozen_bytes
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import _start

    run, _ = prepare(cli, command="posttrain")
    trainer, _, _ = _start(run, task_for(run))
    chunks = trainer.frozen["teacher"].chunks
    held = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    stage = ps.get_pipeline_model_parallel_rank()
    return {
        "held": held,
        "estimate": frozen_bytes(
            _frozen_model("--teacher-model", teacher_dir), run.layout, stage, 4
        ),
    }


def process_reward_scores(cli: list[str], prompts: list[list[int]], answers: list[list[int]]):
    """The run's frozen ``--process-reward-model`` step scores of (prompt, sampled answer)
    token sequences through the rollout's own path: per aggregate, each answer's combined
    score, and under ``"steps"`` each answer's (end token, score) pairs."""
    from dataclasses import replace

    from anyspeed.stages.common.rl import process_reward
    from anyspeed.stages.common.rl.step_scores import step_scores
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import _start

    run, _ = prepare(cli, command="posttrain")
    task = task_for(run)
    trainer, _, _ = _start(run, task)
    src = replace(run.config.process_reward, dense=True)  # the steps' end tokens too
    steps = step_scores(trainer, prompts, answers, run.args, task.pad, task.tok, task.eos, src)
    out: dict = {"steps": steps}
    for how in process_reward.AGGREGATES:
        out[how] = [process_reward.aggregate([v for _, v in s], how) for s in steps]
    return out


def rollout_batches(cli: list[str], rows: list[int], keys: tuple[str, ...]) -> list[dict]:
    """The run's rollout of prompt ``rows`` through the task's own ``rollout``: per
    micro-batch the tensors ``keys`` (those it has), as lists."""
    import numpy as np

    from anyspeed.device import torch_device
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import _start

    run, _ = prepare(cli, command="posttrain")
    task = task_for(run)
    trainer, _, _ = _start(run, task)
    micro = task.rollout(trainer, run.data, np.asarray(rows), range(len(rows)), run.args,
                         torch_device())  # fmt: skip
    return [{k: b[k].cpu().tolist() for k in keys if k in b} for b in micro]


def partial_draw(cli: list[str]) -> dict:
    """The run's first partial rollout (through the task's own drawer) and the same groups
    sampled whole by ``sample_once`` (each prompt's seeds): every answer's tokens and
    log-probs."""
    from anyspeed.stages.common.instruction_data import sample_order
    from anyspeed.stages.prepare import prepare
    from anyspeed.stages.table import task_for
    from anyspeed.training.engine import _start

    run, _ = prepare(cli, command="posttrain")
    task = task_for(run)
    trainer, _, _ = _start(run, task)
    rows = task.cfg.rows
    order = rows[sample_order((0, len(rows)), 4 * task.cfg.rollout_batch, run.args.seed)]
    task.partial.drawer(task, trainer, run.data, order, 0, run.args)()
    flights = task.partial.last.flights
    whole = task.sample_once(trainer, run.data, [f.row for f in flights],
                             [(0, f.key) for f in flights], run.args)  # fmt: skip
    return {"partial": [{"tokens": a.tokens, "logps": a.logps, "rounds": a.rounds}
                        for f in flights for a in f.answers],
            "whole": [{"tokens": t, "logps": lp} for t, lp in zip(whole.tokens, whole.logps,
                                                                 strict=True)]}  # fmt: skip
