"""A process reward model's score of each step of sampled answers. An answer (its sampled end
token dropped) is decoded and cut into steps at ``--prm-step-separator``; each non-empty step is
followed by a space and the placeholder token, and the steps are rejoined with the separator
(``step ки\\nstep ки``: Math-Shepherd's layout, as the PRM was trained on) and encoded after the
prompt's own tokens. At each placeholder the PRM's probability of the first reward token among
the reward tokens (``+`` of ``+ -``) is that step's score. Each step is also placed on the
answer's own tokens: the token whose text completes the step."""

from __future__ import annotations

import sys
from typing import Any

import torch

from anyspeed.stages.common.rl.process_reward import NAME, PRMSource

_warned = False  # the cut warning, once per process


def steps_of(tok: Any, answer: list[int], eos: Any, src: PRMSource) -> tuple[list[str], list[int]]:
    """The non-empty steps of ``answer`` (stripped) and, for each, the index of the answer
    token whose text completes it (found only for step credit, ``src.dense``: it costs prefix
    decodes; else 0)."""
    from anyspeed.inference.generate import decode

    body = answer[:-1] if answer and answer[-1] in eos else answer
    text = decode(tok, body)
    steps, ends, at = [], [], 0
    for part in text.split(src.separator):
        if part.strip():
            steps.append(part.strip())
            ends.append(at + len(part.rstrip()))
        at += len(part) + len(src.separator)
    return steps, _tokens_at(tok, body, ends) if src.dense else [0] * len(steps)


def _tokens_at(tok: Any, body: list[int], ends: list[int]) -> list[int]:
    """For each character offset in ``ends`` (ascending), the first token whose prefix text
    reaches it (a binary search over prefix decodes)."""
    from anyspeed.inference.generate import decode

    out, lo = [], 0
    for end in ends:
        a, b = lo, len(body) - 1
        while a < b:
            mid = (a + b) // 2
            if len(decode(tok, body[: mid + 1])) >= end:
                b = mid
            else:
                a = mid + 1
        out.append(a)
        lo = a
    return out


def with_steps(tok: Any, steps: list[str], src: PRMSource) -> list[int]:
    """The steps as the PRM reads them: each (the placeholder's own text taken out of it, so
    only step ends carry it) followed by `` <placeholder>``, rejoined with the separator,
    encoded."""
    text = src.separator.join(f"{s.replace(src.placeholder, '')} {src.placeholder}" for s in steps)
    return [int(i) for i in tok.encode([text], special=False)[0]] if text else []


def placeholder_scores(logits: torch.Tensor, reward_ids: tuple[int, ...]) -> torch.Tensor:
    """Each position's probability of the first reward token among the reward tokens [b, s],
    from a last stage's fp32 logits [b, s, vocab / TP]."""
    from anyspeed.models.logprobs import vocab_parallel_logits_at

    return torch.softmax(vocab_parallel_logits_at(logits, list(reward_ids)), -1)[..., 0]


def scores(trainer: Any, micro: list[dict[str, Any]], src: PRMSource) -> torch.Tensor:
    """[n, s]: each sequence's step score at its placeholders inside the answer, NaN
    elsewhere, on every rank of the replica, forward only through the pipeline schedule."""
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
        p = placeholder_scores(prepared_logits(out), src.reward_ids)
        return torch.where(steps, p, float("nan"))

    model = trainer.frozen[NAME]
    width = int(micro[0]["tokens"].shape[1])
    with torch.no_grad(), model.context():
        return row_values(trainer, model.chunks, micro, compute, (width,))


def step_scores(
    trainer: Any,
    prompts: list[list[int]],
    answers: list[list[int]],
    args: Any,
    pad: int,
    tok: Any,
    eos: Any,
    src: PRMSource,
) -> list[list[tuple[int, float]]]:
    """Per (prompt, sampled answer), every rank of the replica: (the answer token where the
    step ends, 0 unless ``src.dense``; its score) for each step the PRM read (steps past
    --seq-length are not)."""
    from anyspeed.stages.common.rl.batches import scoring_batches

    split = [steps_of(tok, a, eos, src) for a in answers]
    scored = [with_steps(tok, steps, src) for steps, _ in split]
    _warn_cut(prompts, scored, args.seq_length)
    got = scores(trainer, scoring_batches(prompts, scored, args, pad), src)
    out = []
    for row, (_, ends) in zip(got, split, strict=True):
        values = row[~torch.isnan(row)].tolist()
        out.append(list(zip(ends, values, strict=False)))  # fewer values: cut at the end
    return out


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
