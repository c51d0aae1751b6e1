"""The teacher of ``--stage distill``: a frozen causal LM reading the student's tokens, checked
before start (a Hugging Face directory converted once, as ``--load`` converts one), built at
the training layout beside the student, and its log-probability of every sampled token."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from anyspeed.errors import UsageError
from anyspeed.training.task import FrozenModel

NAME = "teacher"  # the frozen model's name in the trainer
FLAG = "--teacher-model"


def check(args: argparse.Namespace) -> tuple[str, Any]:
    """(checkpoint, architecture when not the student's) of ``--teacher-model``, checked: a
    whole checkpoint of a model sharing the student's vocabulary whose heads and layers the
    training layout splits."""
    from anyspeed.checkpoint.reads import tracked_dir
    from anyspeed.distributed.process import planned_world_size
    from anyspeed.models.presets import model_from_args
    from anyspeed.stages.common.rl.reward_layout import architecture, check_fits_layout
    from anyspeed.stages.common.value_head import check_model_dir

    path = args.teacher_model
    if path is None:
        raise UsageError(
            f"--stage distill needs {FLAG}: a checkpoint or Hugging Face directory of the "
            "model to distil from"
        )
    if not os.path.isdir(path):
        raise UsageError(f"{FLAG} {path!r} is not a directory")
    if tracked_dir(path) is None:
        path = _from_hf(args, path)
    student = model_from_args(args)
    own = architecture(args, path, student, flag=FLAG)
    if own is not None:
        world = planned_world_size(args.nproc_per_node)
        check_fits_layout(args, own, world, FLAG, "choose sizes that split both models")
    return check_model_dir(args, path, FLAG, head=False, model=own or student), own


def _from_hf(args: argparse.Namespace, path: str) -> str:
    """A Hugging Face causal-LM directory converted once beside the run's conversions."""
    from anyspeed.convert import hf_cache
    from anyspeed.convert.hf_io import read_config
    from anyspeed.convert.reward import is_reward_config

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(
            f"{FLAG} {path!r} is neither a checkpoint (no tracker file) nor a Hugging Face "
            "model directory (no config.json)"
        )
    try:
        cfg = read_config(path, raw=True)
    except UsageError as exc:
        raise UsageError(f"{FLAG}: {exc}") from None
    if is_reward_config(cfg):
        raise UsageError(
            f"{FLAG} {path!r} is a reward model (*ForSequenceClassification); a teacher is a "
            "causal LM (*ForCausalLM)"
        )
    _check_tokens(path, args.tokenizer_name_or_path)
    return hf_cache.convert(args, path, "anyspeed posttrain --stage distill", flag=FLAG)


def _check_tokens(teacher: str, student: str | None) -> None:
    """Where both directories hold a ``tokenizer.json``, the teacher's must give every token
    the student's id: the two models' probabilities are compared token id by token id (a
    vocabulary of the same size is not enough)."""
    theirs = _vocab(teacher)
    ours = _vocab(student) if student else None
    if theirs is None or ours is None or theirs == ours:
        return
    moved = sum(theirs.get(t) != i for t, i in ours.items())
    raise UsageError(
        f"{FLAG} {teacher!r}: its tokenizer differs from --tokenizer-name-or-path {student!r} "
        f"({moved} of {len(ours)} tokens have another id or none); a teacher must share the "
        "student's tokenizer"
    )


def _vocab(directory: str) -> dict[str, int] | None:
    """Every token's id (added tokens included) in ``directory``'s ``tokenizer.json``; None
    where it has none or it cannot be read (nothing to compare)."""
    from pathlib import Path

    from anyspeed.convert.hf_io import read_json

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
        vocab = dict(doc["model"]["vocab"])
    except (UsageError, KeyError, TypeError, ValueError):
        return None
    vocab.update({t["content"]: t["id"] for t in doc.get("added_tokens") or [] if "content" in t})
    return vocab


def frozen(path: str, model: Any) -> dict[str, FrozenModel]:
    """The frozen teacher the task asks the engine for."""
    return {NAME: FrozenModel(load=path, model=model)}


def topk(
    trainer: Any, micro: list[dict[str, Any]], vocab: int, temperature: float, k: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """Per micro-batch, the teacher's log-probability of the labels [b, s], its ``k`` most
    likely next tokens [b, s, k] and their log-probabilities [b, s, k], at the sampling
    temperature over the student's real vocabulary, forward only; None off the last pipeline
    stage."""
    from anyspeed.models.logprobs import (
        prepared_logits,
        vocab_parallel_logprobs_at,
        vocab_parallel_topk,
    )
    from anyspeed.training.logprob_pass import output_pass
    from anyspeed.training.model_pipeline import unwrap

    k = min(k, vocab)

    def compute(chunk: torch.nn.Module, b: dict) -> torch.Tensor:
        out = chunk(b["tokens"], b["position_ids"], None)
        if not unwrap(chunk).post_process:
            return out  # a stage before the last sends its hidden states on
        logits = prepared_logits(out, vocab, temperature)
        ids = vocab_parallel_topk(logits, k)
        lp = vocab_parallel_logprobs_at(logits, torch.cat([b["labels"][..., None], ids], -1))
        return torch.cat([lp, ids.to(lp.dtype)], -1)  # ids < 2**24: exact in fp32

    frozen = trainer.frozen[NAME]
    with torch.no_grad(), frozen.context():
        out = output_pass(trainer, frozen.chunks, micro, compute)
    if out is None:
        return None
    return [(o[..., 0], o[..., 1 + k :].long(), o[..., 1 : 1 + k]) for o in out]


def logprobs(
    trainer: Any, micro: list[dict[str, Any]], vocab: int, temperature: float
) -> list[torch.Tensor] | None:
    """The teacher's log-probability of each micro-batch's labels ([b, s] each) at the
    sampling temperature, forward only, over the student's real vocabulary (the rows both
    pad are never a choice); None off the last pipeline stage."""
    return trainer.logprobs(micro, model=NAME, vocab_size=vocab, temperature=temperature)
