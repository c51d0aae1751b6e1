"""Batched autoregressive decoding with Megatron's static KV cache, at any TP/PP layout.

Prompts are left-padded into one batch; padding is hidden by an explicit attention mask and
real positions count from each prompt's first token. With the KV cache the prompt is run once
(prefill) through a ``StaticInferenceContext`` and each later step feeds one token per row;
without it every step re-runs the whole sequence (the reference the cache is tested against).
Every choice is made on the last pipeline stage and broadcast over the pipeline group, so all
ranks step in lock-step and return the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from anyspeed.inference.sampling import SamplingParams, next_tokens
from anyspeed.inference.stepper import Batch, Stepper, share

__all__ = ["Batch", "Kept", "PromptTooLong", "Request", "Stepper", "generate", "sample", "share"]

OnTokens = Callable[[list[int | None]], None]  # one new token per row (None: row finished)


class PromptTooLong(ValueError):
    """A prompt does not fit in the context window."""


@dataclass
class Request:
    """What to generate for a batch of token-id prompts."""

    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    use_kv_cache: bool = True
    seed: int = 1234
    # One seed per row: each row samples from its own generator, so its tokens do not depend
    # on which other rows share the batch (a rollout split over data-parallel replicas).
    row_seeds: tuple[int, ...] | None = None
    # Every rank steps until all are done, prompts padded to the widest of all: ranks decoding
    # different prompts whose layers still exchange tokens (expert parallelism across
    # data-parallel replicas) must run the same forwards.
    lockstep: bool = False
    max_length: int | None = None  # the context window (prompt + new tokens)
    vocab_size: int | None = None  # real vocabulary: padded rows of the embedding never chosen
    # A row stops once its text (``detokenize`` of its new tokens, leading whitespace dropped)
    # contains one of ``stop`` (the tokens that complete it are kept, as at an EOS).
    stop: tuple[str, ...] = ()
    detokenize: Callable[[list[int]], str] | None = None
    # Rows that have ended leave the batch and its KV cache (once a quarter of the rows left
    # have): later steps compute only the rows still decoding. Done where it changes no
    # token (greedy, or a generator per row) and no caller needs the batch whole.
    compact: bool = True

    def stops(self, new: list[int]) -> bool:
        """Whether a row with new tokens ``new`` ends here (an EOS or a stop string)."""
        if new and new[-1] in self.eos_ids:
            return True
        if not self.stop or self.detokenize is None:
            return False
        text = self.detokenize(new).lstrip()
        return any(s in text for s in self.stop)


def token_budget(width: int, req: Request) -> int:
    if req.max_length is not None and width >= req.max_length:
        raise PromptTooLong(
            f"a prompt of {width} tokens does not fit in the context of "
            f"{req.max_length} tokens (--max-length / --seq-length)"
        )
    room = req.max_new_tokens if req.max_length is None else req.max_length - width
    return max(0, min(req.max_new_tokens, room))


@torch.inference_mode()
def generate(
    model: list[torch.nn.Module],
    prompts: Sequence[Sequence[int]],
    req: Request,
    on_tokens: OnTokens | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt (ending at and including an EOS id or the tokens that
    complete a stop string), identical on every rank; ``on_tokens`` hears each step's tokens as
    they come (for streaming)."""
    return sample(model, prompts, req, on_tokens)[0]


@dataclass
class Kept:
    """The KV cache of a batch :func:`sample` decoded, kept so that a later call continues its
    rows (multi-turn rollouts): set ``rows`` to the kept rows the next call's prompts extend,
    in order; each next prompt must start with its row's prompt and sampled tokens."""

    stepper: Stepper | None = None
    rows: list[int] | None = None
    resumed: int = 0  # calls that continued the kept cache (rather than starting afresh)
    # the rows of the caller's last batch this process decoded, where a caller splits its
    # batch over processes (a rollout model's ranks); None: all of them
    owned: list[int] | None = None


def sample(
    model: list[torch.nn.Module],
    prompts: Sequence[Sequence[int]],
    req: Request,
    on_tokens: OnTokens | None = None,
    logprobs: bool = False,
    kept: Kept | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """:func:`generate`, and with ``logprobs`` each new token's log-probability under the
    sampling temperature's distribution (before top-k/top-p: the policy's, as training
    recomputes it), identical on every rank. With ``kept`` the batch's KV cache is kept, and
    a call whose ``kept.rows`` is set extends the kept cache instead of re-reading the prompts
    where the model allows it (:mod:`anyspeed.inference.resume`)."""
    stepper = None
    if kept is not None and kept.stepper is not None and kept.rows is not None:
        from anyspeed.inference.resume import resumed

        stepper = resumed(kept.stepper, kept.rows, prompts, req, token_budget)
        kept.resumed += stepper is not None
    if stepper is None:
        width = _widest(max(len(p) for p in prompts)) if req.lockstep else None
        batch = Batch.left_padded(prompts, req.pad_id, width)
        steps = token_budget(batch.tokens.shape[1], req)
        total = batch.tokens.shape[1] + steps
        stepper = Stepper(model, batch, total, req.use_kv_cache, req.vocab_size)
    # (not for a kept cache, which continues the whole batch, nor in lockstep)
    compact = req.compact and kept is None and not req.lockstep
    compact = compact and (req.params.greedy or bool(req.row_seeds))
    out = _decode(stepper, len(prompts), req, on_tokens, logprobs, compact)
    if kept is not None:
        kept.stepper, kept.rows = stepper, None
    return out


def _decode(
    stepper: Stepper,
    n: int,
    req: Request,
    on_tokens: OnTokens | None,
    logprobs: bool,
    compact: bool = False,
) -> tuple[list[list[int]], list[list[float]]]:
    """Step ``stepper`` until every row of ``n`` ends or its budget is spent. With
    ``compact``, once a quarter of the rows still in the batch have ended they leave it (and
    its KV cache): the later steps compute only the rows still sampling."""
    steps = stepper.total - stepper.seq.shape[1]
    gen = torch.Generator().manual_seed(req.seed)
    rows = [torch.Generator().manual_seed(s) for s in req.row_seeds] if req.row_seeds else None
    out: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    done = [False] * n
    live = list(range(n))  # the rows in the stepper's batch, in its order
    for _ in range(steps):
        chosen, lp = _choose(stepper, live, req, gen, rows, logprobs)
        fresh: list[int | None] = [None] * n
        for i, tok, p in zip(live, chosen.tolist(), lp.tolist(), strict=True):
            if not done[i]:
                fresh[i] = tok
                out[i].append(tok)
                lps[i].append(p)
                done[i] = req.stops(out[i])
        stepper.append(chosen)
        if on_tokens is not None:
            on_tokens(fresh)
        if _widest(int(not all(done))) == 0 if req.lockstep else all(done):
            break
        ended = [j for j, i in enumerate(live) if done[i]]
        if compact and 4 * len(ended) >= len(live):
            keep = [j for j, i in enumerate(live) if not done[i]]
            compact = stepper.keep_rows(keep)
            live = [live[j] for j in keep] if compact else live
    return out, lps


def _choose(
    stepper: Stepper,
    live: list[int],
    req: Request,
    gen: torch.Generator,
    rows: list[torch.Generator] | None,
    logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row of the batch (rows ``live``) and its log-probability under
    the sampling temperature, the same on every rank."""
    logits = stepper.logits()
    chosen = torch.zeros(len(live), dtype=torch.int64)
    lp = torch.zeros(len(live), dtype=torch.float32)
    if logits is not None:
        chosen = next_tokens(logits, req.params, gen, [rows[i] for i in live] if rows else None)
        if logprobs:
            scaled = logits.float() / (1.0 if req.params.greedy else req.params.temperature)
            lp = torch.log_softmax(scaled, -1).gather(1, chosen[:, None])[:, 0]
    chosen = share(chosen)
    return chosen, share(lp) if logprobs else lp


def _widest(n: int) -> int:
    """The largest ``n`` of all ranks."""
    import torch.distributed as dist

    from anyspeed.device import torch_device

    t = torch.tensor([n], device=torch_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
