"""Rewards from a process reward model (``--process-reward-model``): an ``--stage prm``
checkpoint, or a Hugging Face ``*ForCausalLM`` PRM directory converted once, built frozen at the
training layout beside the policy. Each sampled answer is cut into steps at
``--prm-step-separator``; every step is followed by a space and the placeholder token, and
rejoined (``step ки\\nstep ки``: Math-Shepherd's layout, as the PRM was trained on), after the
prompt's own tokens. At each placeholder the PRM's probability of the first reward token among
the reward tokens (``+`` of ``+ -``) is the step's score; ``--prm-aggregate`` (min, the weakest
step, by default) makes it the answer's, which, times ``--prm-weight``, adds to the rewards."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import torch

from anyspeed.errors import UsageError
from anyspeed.training.task import FrozenModel

_warned = False  # the cut warning, once per process
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


def check(args: argparse.Namespace) -> PRMSource | None:
    """``--process-reward-model``, checked before start (None: not given): a causal LM
    reading the policy's tokens whose step tokens are one token each; the tokens come from
    the flags, else from an ``--stage prm`` checkpoint's record, else Math-Shepherd's."""
    from anyspeed.data.errors import UsageError as DataUsageError
    from anyspeed.data.process_reward import single_token
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.stages.common.rl.frozen_lm import check_causal_lm

    if args.process_reward_model is None:
        return None
    tok = load_tokenizer(TokenizerSpec(name_or_path=args.tokenizer_name_or_path))
    path, own = check_causal_lm(args, args.process_reward_model, FLAG)
    placeholder, rewards = _step_tokens(args, path)
    try:
        ph = single_token(tok, placeholder, "--prm-placeholder-token")
        ids = tuple(single_token(tok, t, "--prm-reward-tokens") for t in rewards)
    except DataUsageError as exc:
        raise UsageError(str(exc)) from None
    if len(set(ids)) != len(ids) or ph in ids or len(ids) < 2:
        raise UsageError(
            "--prm-reward-tokens: give two or more distinct tokens (the good one first), none "
            "of them --prm-placeholder-token"
        )
    if not args.prm_step_separator:
        raise UsageError("--prm-step-separator must not be empty (the steps' boundary, e.g. \\n)")
    return PRMSource(
        path, own, placeholder, ph, ids, args.prm_step_separator, args.prm_aggregate,
        args.prm_weight,
    )  # fmt: skip


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


def with_steps(tok: Any, answer: list[int], eos: Any, src: PRMSource) -> list[int]:
    """``answer`` (its sampled end token dropped) as the PRM reads it: its text cut at the
    separator, each non-empty step followed by `` <placeholder>``, rejoined and encoded."""
    from anyspeed.inference.generate import decode

    body = answer[:-1] if answer and answer[-1] in eos else answer
    steps = [s.strip() for s in decode(tok, body).split(src.separator)]
    text = src.separator.join(f"{s} {src.placeholder}" for s in steps if s)
    return [int(i) for i in tok.encode([text], special=False)[0]] if text else []


def step_scores(logits: torch.Tensor, reward_ids: tuple[int, ...]) -> torch.Tensor:
    """Each position's probability of the first reward token among the reward tokens [b, s],
    from a last stage's fp32 logits [b, s, vocab / TP]."""
    from anyspeed.models.logprobs import vocab_parallel_logits_at

    return torch.softmax(vocab_parallel_logits_at(logits, list(reward_ids)), -1)[..., 0]


def combine(p: torch.Tensor, steps: torch.Tensor, how: str) -> torch.Tensor:
    """Per row, the step scores ``p`` [b, s] at ``steps`` (bool [b, s]) combined ``how``; 0
    for a row without a step."""
    n = steps.sum(-1)
    if how == "min":
        out = p.masked_fill(~steps, float("inf")).amin(-1)
    elif how == "mean":
        out = (p * steps).sum(-1) / n.clamp(min=1)
    elif how == "prod":
        out = torch.where(steps, p, 1.0).prod(-1)
    else:  # last
        pos = torch.arange(p.shape[-1], device=p.device)
        out = p.gather(-1, (steps * pos).amax(-1, keepdim=True))[..., 0]
    return torch.where(n > 0, out, 0.0)


def scores(trainer: Any, micro: list[dict[str, Any]], src: PRMSource) -> torch.Tensor:
    """Each sequence's combined step score [n] on every rank of the replica, forward only
    through the pipeline schedule; steps are the placeholders inside the answer."""
    from anyspeed.models.logprobs import prepared_logits
    from anyspeed.training.logprob_pass import row_values
    from anyspeed.training.model_pipeline import unwrap

    def compute(chunk: torch.nn.Module, b: dict) -> torch.Tensor:
        out = chunk(b["tokens"], b["position_ids"], None)
        if not unwrap(chunk).post_process:
            return out  # a stage before the last sends its hidden states on
        answer = torch.zeros_like(b["loss_mask"], dtype=torch.bool)
        answer[:, 1:] = b["loss_mask"][:, :-1] > 0  # labels are shifted: tokens one on
        steps = answer & (b["tokens"] == src.placeholder_id)
        return combine(step_scores(prepared_logits(out), src.reward_ids), steps, src.aggregate)

    model = trainer.frozen[NAME]
    with torch.no_grad(), model.context():
        return row_values(trainer, model.chunks, micro, compute)


def score_sequences(
    trainer: Any, prompts: list[list[int]], answers: list[list[int]], args: Any, pad: int,
    tok: Any, eos: Any, src: PRMSource,
) -> list[float]:  # fmt: skip
    """The PRM's combined step score of each (prompt, sampled answer), every rank of the
    replica: the answers with their placeholders, in micro-batches made as the rollout's are."""
    from anyspeed.device import torch_device
    from anyspeed.stages.common.rl.batches import Rollout, micro_batches

    scored = [with_steps(tok, a, eos, src) for a in answers]
    _warn_cut(prompts, scored, args.seq_length)
    zero = torch.zeros(len(scored), dtype=torch.float64)
    roll = Rollout(prompts, scored, [[0.0] * len(a) for a in scored], zero, zero, 1, 0)
    return scores(trainer, micro_batches(roll, args, pad, torch_device()), src).tolist()


def _warn_cut(prompts: list[list[int]], scored: list[list[int]], seq_length: int) -> None:
    """Once: samples whose steps (with their placeholders) run past --seq-length lose their
    last steps' scores."""
    global _warned
    from anyspeed.launch import reports_here

    cut = sum(len(p) + len(a) > seq_length for p, a in zip(prompts, scored, strict=True))
    if cut and not _warned and reports_here():
        _warned = True
        print(
            f"anyspeed posttrain: warning: {cut} of {len(scored)} samples with their step "
            f"placeholders are longer than --seq-length {seq_length}: their last steps are "
            "not scored; raise --seq-length (a placeholder adds about two tokens a step)",
            file=sys.stderr,
        )
