"""Partial rollout (MindSpeed-RL's ``partial_rollout_max_split``): a long answer is sampled over
several rollouts instead of holding up the one it started in.

With ``--partial-rollout-max-split N`` each round of sampling gives every unfinished answer at
most ``ceil(--max-response-length / N)`` new tokens. A rollout holds the groups carried over
from the last one and a new batch of prompts (two batches at the start), runs rounds until
``--rollout-batch-size`` groups have every answer finished (at least one round), and trains
on those, oldest first. The rest wait, with their answers so far, for the next rollout, whose
newer policy continues them. An answer gets a round in every rollout it waits, so it is done
within N rollouts: a group is at most N - 1 policy versions stale (``partial_rollout/age``).

The rollout keeps the log-prob each token was sampled with, so ``rollout/logp_mismatch``
measures the staleness and ``--rollout-is`` corrects for it. The buffer is global (the same on
every rank): each round splits the unfinished answers over the data-parallel replicas, so a run
draws the same groups at every layout. Each checkpoint keeps it (``partial_rollout.json``), so
a resumed run continues the same answers.

Where the win comes from: a rollout without it decodes its whole batch until its longest
answer ends; here the long ones are cut into rounds shared with new prompts' samples.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from anyspeed.errors import UsageError

FILE = "partial_rollout.json"
# the draws' statistics (after the rollout's, in the task's metrics)
STATS = (
    "partial_rollout/age",
    "partial_rollout/age_max",
    "partial_rollout/carried_groups",
    "partial_rollout/rounds",
    "partial_rollout/generated_tokens",
)


@dataclass(frozen=True)
class PartialConfig:
    """The checked flag: rounds of ``chunk`` new tokens, ``split`` of them per answer at most."""

    split: int
    chunk: int


def add_arguments(g: Any) -> None:
    g.add_argument(
        "--partial-rollout-max-split",
        type=int,
        default=1,
        help="N > 1: sample answers in rounds of --max-response-length / N tokens; a group "
        "not finished when enough others are continues in the next rollout (at most N)",
    )


def from_args(args: argparse.Namespace) -> PartialConfig | None:
    """The partial rollout of a run, checked (one line each); None: off (a split of 1)."""
    split, most = args.partial_rollout_max_split, args.max_response_length
    if split <= 1:
        return None
    if split > most:
        raise UsageError(
            f"--partial-rollout-max-split {split} exceeds --max-response-length {most}: each "
            "round samples at least one token; use a split of at most the answer length"
        )
    if getattr(args, "tools", None):
        raise UsageError(
            "--partial-rollout-max-split with --tools is not supported (a multi-turn "
            "trajectory is sampled whole); use a split of 1"
        )
    if getattr(args, "filter_groups", False):
        raise UsageError(
            "--partial-rollout-max-split with --filter-groups is not supported (dynamic "
            "sampling refills a rollout with new prompts); use one of them"
        )
    return PartialConfig(split, -(-most // split))


@dataclass
class Answer:
    """One sample, as far as it is sampled: its tokens and the log-prob each was sampled with."""

    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    rounds: int = 0
    done: bool = False


@dataclass
class Flight:
    """One prompt's group in the buffer."""

    row: int  # the prompt's row of the data
    key: int  # its place in the run's prompt order (it seeds the samples)
    age: int = 0  # rollouts it was carried over
    answers: list[Answer] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(a.done for a in self.answers)


@dataclass(frozen=True)
class Drawn:
    """A rollout's groups (every replica's, oldest first) and how they were drawn."""

    flights: list[Flight]
    rounds: int
    carried: int  # groups left for the next rollout
    generated: int  # tokens sampled in this rollout's rounds

    def stats(self) -> list[float]:
        """The values of :data:`STATS`."""
        ages = [f.age for f in self.flights]
        return [sum(ages) / len(ages), max(ages), self.carried, self.rounds, self.generated]


# (answers to continue as (group, sample), new tokens at most) -> each one's (tokens, log-probs)
Continue = Callable[[list[tuple[Flight, int]], int], list[tuple[list[int], list[float]]]]
# a prompt batch's index -> its (row, key) pairs
Prompts = Callable[[int], list[tuple[int, int]]]


class Buffer:
    """The groups in flight, the same on every rank, and the next prompt batch to add."""

    def __init__(self, cfg: PartialConfig, group: int, per_rollout: int, eos: tuple[int, ...]):
        self.cfg, self.group, self.per_rollout, self.eos = cfg, group, per_rollout, eos
        self.flights: list[Flight] = []
        self.next_batch: int | None = None  # None: nothing added yet

    def state(self) -> dict[str, Any]:
        """A JSON-able copy (a checkpoint's)."""
        return {"next_batch": self.next_batch, "flights": [asdict(f) for f in self.flights]}

    def load(self, state: dict[str, Any]) -> None:
        self.next_batch = state["next_batch"]
        self.flights = [
            Flight(f["row"], f["key"], f["age"], [Answer(**a) for a in f["answers"]])
            for f in state["flights"]
        ]

    def draw(self, at: int, prompts: Prompts, cont: Continue, max_response: int) -> Drawn:
        """Rollout ``at``'s groups: prompt batches up to ``at + 1`` added, rounds until enough
        groups are done, the oldest of them taken out; the others age by one."""
        if self.next_batch is None:
            self.next_batch = at
        while self.next_batch <= at + 1:
            for row, key in prompts(self.next_batch):
                self.flights.append(Flight(row, key, 0, [Answer() for _ in range(self.group)]))
            self.next_batch += 1
        rounds = generated = 0
        while rounds == 0 or sum(f.done for f in self.flights) < self.per_rollout:
            pending = [(f, i) for f in self.flights for i, a in enumerate(f.answers) if not a.done]
            if not pending:
                break
            generated += self._round(pending, cont, max_response)
            rounds += 1
        chosen = [f for f in self.flights if f.done][: self.per_rollout]
        if len(chosen) < self.per_rollout:
            raise RuntimeError(f"partial rollout: {len(chosen)} groups done, not enough")
        taken = {id(f) for f in chosen}
        self.flights = [f for f in self.flights if id(f) not in taken]
        for f in self.flights:
            f.age += 1
        return Drawn(chosen, rounds, len(self.flights), generated)

    def _round(self, pending: list[tuple[Flight, int]], cont: Continue, max_response: int) -> int:
        """One round: each unfinished answer continued by up to a chunk (answers with less
        room left go in a call of their own); the tokens sampled."""
        by_budget: dict[int, list[tuple[Flight, int]]] = {}
        for f, i in pending:
            room = min(self.cfg.chunk, max_response - len(f.answers[i].tokens))
            by_budget.setdefault(room, []).append((f, i))
        sampled = 0
        for budget in sorted(by_budget, reverse=True):
            items = by_budget[budget]
            for (f, i), (tokens, logps) in zip(items, cont(items, budget), strict=True):
                a = f.answers[i]
                a.tokens += tokens
                a.logps += logps
                a.rounds += 1
                sampled += len(tokens)
                ended = bool(tokens) and tokens[-1] in self.eos
                a.done = ended or len(tokens) < budget or len(a.tokens) >= max_response
        return sampled
