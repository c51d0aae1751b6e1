"""Rewards from a trained reward model (``--reward-model``): an ``--stage orm`` checkpoint (or
a one-label ``*ForSequenceClassification`` Hugging Face directory, converted once) of the
policy's architecture, built frozen at the training layout in the same processes, scores
each sampled sequence (prompt and answer) at its last token, as the reward model was trained
and as transformers' ``*ForSequenceClassification`` of its export pools. The answer is closed as
the chat template (``--prompt-type``) closes an assistant turn (``<|im_end|>\n`` for chatml, in
place of the sampled end token), so the scored sequence ends as the reward model's training
pairs did: scored at a sampled ``<|im_end|>`` instead of the ``\n`` after it, a demo's reward
model gave scores 4 apart from its training range and PPO learnt what it had never seen. Its
score, times ``--reward-model-weight``, adds to the rule rewards (``--verifier-function``).
A reward model of another architecture, or run whole on every rank: :mod:`.reward_layout`."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from anyspeed.errors import UsageError
from anyspeed.stages.common.rl.reward_layout import RewardSource, WholeRewardModel
from anyspeed.training.task import FrozenModel

NAME = "reward_model"  # the frozen model's name in the trainer


def check(args: argparse.Namespace) -> RewardSource | None:
    """``--reward-model``, checked before start: a checkpoint directory whose files are whole,
    with a value head, reading the policy's tokens; its architecture when not the policy's and
    where it runs (:mod:`.reward_layout`). None: not given."""
    from anyspeed.checkpoint.reads import tracked_dir
    from anyspeed.distributed.process import planned_world_size
    from anyspeed.models.presets import model_from_args
    from anyspeed.stages.common.rl.reward_layout import architecture, check_fits_layout, wants_whole
    from anyspeed.stages.common.value_head import check_model_dir

    path = args.reward_model
    if path is None:
        return None
    whole = wants_whole(args)
    if os.path.isdir(path) and tracked_dir(path) is None:
        path = _from_hf(args, path, f"--reward-model {path!r}", whole)
    policy = model_from_args(args)
    own = architecture(args, path, policy) if tracked_dir(path) else None
    if own is not None and not whole:
        check_fits_layout(args, own, planned_world_size(args.nproc_per_node))
    path = check_model_dir(args, path, "--reward-model", head=True, model=own or policy)
    return RewardSource(path, own, whole)


def _from_hf(args: argparse.Namespace, path: str, flag: str, whole: bool) -> str:
    """A Hugging Face ``*ForSequenceClassification`` directory (one label) converted, once,
    into a reward-model checkpoint beside the run's conversions (at TP 1 for a reward model
    run whole); other directories as given."""
    from anyspeed.convert import hf_cache
    from anyspeed.convert.hf_io import read_config
    from anyspeed.convert.reward import is_reward_config

    if not os.path.isfile(os.path.join(path, "config.json")):
        return path
    try:
        cfg = read_config(path, raw=True)
    except UsageError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    if not is_reward_config(cfg):
        raise UsageError(
            f"{flag} is a Hugging Face model but not a one-label *ForSequenceClassification "
            "(a reward model); give one, or an --stage orm checkpoint"
        )
    prog = f"anyspeed posttrain --stage {args.stage}"
    if whole:
        args = argparse.Namespace(**{**vars(args), "tensor_model_parallel_size": 1})
    return hf_cache.convert(args, path, prog, flag="--reward-model")


def frozen(src: RewardSource) -> dict[str, FrozenModel]:
    """The frozen model the policy task asks the engine for (none when it runs whole: the
    task builds it in its own groups)."""
    from anyspeed.models.reward_head import reward_head

    if src.whole:
        return {}
    return {NAME: FrozenModel(load=src.path, transforms=(reward_head,), model=src.model)}


def turn_end(tok: Any, prompt_type: str | None) -> list[int] | None:
    """The tokens that close an assistant turn under ``prompt_type`` (None: no template, the
    answer is scored as sampled)."""
    from anyspeed.data.templates import TEMPLATES

    if prompt_type is None or prompt_type not in TEMPLATES:
        return None
    template = TEMPLATES[prompt_type]
    suffix = template.assistant.split("{content}", 1)[1]
    ids = [int(i) for i in tok.encode([suffix], special=False)[0]] if suffix else []
    if template.eod_after_response and tok.eod_id is not None:
        ids.append(int(tok.eod_id))
    return ids


def closed(answer: list[int], eos: set[int] | tuple[int, ...], end: list[int] | None) -> list[int]:
    """``answer`` as the reward model reads it: without its sampled end token, closed by the
    template's turn end (unchanged without a template)."""
    if end is None:
        return answer
    body = answer[:-1] if answer and answer[-1] in eos else answer
    return body + end


def score_sequences(
    trainer: Any,
    prompts: list[list[int]],
    answers: list[list[int]],
    args: Any,
    pad: int,
    whole: WholeRewardModel | None = None,
) -> list[float]:
    """The reward model's score of each (prompt, answer), every rank of the replica: in
    micro-batches of ``--micro-batch-size`` made as the rollout's are."""
    from anyspeed.stages.common.rl.batches import scoring_batches

    micro = scoring_batches(prompts, answers, args, pad)
    return (whole.scores(micro) if whole else scores(trainer, micro)).tolist()


def scores(trainer: Any, micro: list[dict[str, Any]]) -> torch.Tensor:
    """Each sequence's score [n] (every rank of the replica): the frozen reward model's head at
    the last token of prompt and answer, forward only through the pipeline schedule."""

    from anyspeed.stages.common.value_head import last_token
    from anyspeed.training.logprob_pass import row_values
    from anyspeed.training.model_pipeline import unwrap

    model = trainer.frozen[NAME]

    def compute(chunk: torch.nn.Module, b: dict) -> torch.Tensor:
        out = chunk(b["tokens"], b["position_ids"], None)
        if not unwrap(chunk).post_process:
            return out  # a stage before the last sends its hidden states on
        at = last_token(b["loss_mask"])
        return out[..., 0].float().gather(1, at[:, None])[:, 0]

    with torch.no_grad(), model.context():
        return row_values(trainer, model.chunks, micro, compute)
