"""The teacher of ``--stage distill``: a frozen causal LM reading the student's tokens, checked
before start (a Hugging Face directory converted once, as ``--load`` converts one), built at
the training layout beside the student, and its log-probability of every sampled token."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from anyspeed.errors import UsageError
from anyspeed.training.task import FrozenModel

NAME = "teacher"  # the frozen model's name in the trainer
FLAG = "--teacher-model"


def check(args: argparse.Namespace) -> tuple[str, Any]:
    """(checkpoint, architecture when not the student's) of ``--teacher-model``, checked
    (:func:`anyspeed.stages.common.rl.frozen_lm.check_causal_lm`)."""
    from anyspeed.stages.common.rl.frozen_lm import check_causal_lm

    if args.teacher_model is None:
        raise UsageError(
            f"--stage distill needs {FLAG}: a checkpoint or Hugging Face directory of the "
            "model to distil from"
        )
    return check_causal_lm(args, args.teacher_model, FLAG)


def frozen(path: str, model: Any, packed: Any = None) -> dict[str, FrozenModel]:
    """The frozen teacher the task asks the engine for (``packed``: it reads packed
    sequences)."""
    from anyspeed.stages.common.reference import packed_transforms

    return {NAME: FrozenModel(load=path, model=model, transforms=packed_transforms(packed))}


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
    from anyspeed.training.packed_rows import model_inputs, to_rows

    k = min(k, vocab)

    def compute(chunk: torch.nn.Module, b: dict) -> torch.Tensor:
        tokens, pos, labels, packed = model_inputs(b)
        out = chunk(tokens, pos, None, packed_seq_params=packed)
        if not unwrap(chunk).post_process:
            return out  # a stage before the last sends its hidden states on
        logits = prepared_logits(out, vocab, temperature)
        ids = vocab_parallel_topk(logits, k)
        lp = vocab_parallel_logprobs_at(logits, torch.cat([labels[..., None], ids], -1))
        return to_rows(torch.cat([lp, ids.to(lp.dtype)], -1), b, 1)  # ids < 2**24: exact

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
