"""Multi-turn rollouts with tool calls (``--tools``): the policy answers; each tool call in its
turn (hermes-style, as the chat template renders calls) is run, the answers are appended as
the chat template's tool turn, which ends by opening the next assistant turn, and sampling goes
on, up to ``--max-tool-calls`` tool turns per sample. The tool turns' tokens sit in the
sequence (the model reads them) but are masked out of the loss, the advantages and the KL.

The sequence is built by concatenation, never re-tokenized: prompt + the sampled turn (ending
with its end-of-turn token) + the tool turn's tokens + the next sampled turn ..., so the
rollout's log-probs are those of the very tokens training reads. The tool turn's tokens are
what the tokenizer's chat template adds after an assistant turn that called tools: the
rendering of a small conversation with the tool messages, less its rendering without them,
cut at the end-of-turn token. A tool turn that would take the answer past
``--max-response-length`` (or the sequence past ``--seq-length``) is not added: the sample
ends there, as TRL's GRPO does.

Tools run on one rank of each replica (the first of its model-parallel group) and their answers
are broadcast, so every rank of the replica continues the same sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from anyspeed.stages.common.rl.tools import Answer, Toolbox, parse_calls

Sampler = Callable[..., tuple[list[list[int]], list[list[float]]]]  # (prompts, request, kept=)


@dataclass
class ToolStats:
    """What the tools did in one rollout (this replica)."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0
    samples: int = 0
    resumed: int = 0  # later turns that extended the KV cache instead of re-reading

    def merge(self, other: ToolStats) -> None:
        """Add another sampling try's counts (``--filter-groups`` samples again)."""
        self.calls += other.calls
        self.errors += other.errors
        self.timeouts += other.timeouts
        self.seconds += other.seconds
        self.samples += other.samples
        self.resumed += other.resumed

    def add(self, answers: list[Answer]) -> None:
        self.calls += len(answers)
        self.errors += sum(a.error for a in answers)
        self.timeouts += sum(a.timeout for a in answers)
        self.seconds += sum(a.seconds for a in answers)


@dataclass
class Trajectories:
    """Each sample's answer tokens (tool turns included), their rollout log-probs (0 at tool
    tokens), the mask of the model's own tokens, and where its last turn starts."""

    tokens: list[list[int]]
    logps: list[list[float]]
    masks: list[list[int]]
    last: list[int]
    stats: ToolStats = field(default_factory=ToolStats)


class ToolTurns:
    """The multi-turn loop of one run: its tools, template and limits."""

    def __init__(
        self,
        tok: Any,
        toolbox: Toolbox,
        eos: tuple[int, ...],
        max_turns: int,
        max_response: int,
        max_length: int,
    ) -> None:
        self.tok, self.toolbox, self.eos = tok, toolbox, eos
        self.max_turns, self.max_response, self.max_length = max_turns, max_response, max_length

    def run(
        self,
        sample: Sampler,
        prompts: list[list[int]],
        tokens: list[list[int]],
        logps: list[list[float]],
        req: Any,
        kept: Any = None,
    ) -> Trajectories:
        """Continue each sampled first turn through its tool calls. ``kept`` holds the first
        turn's KV cache: each later turn extends it (:mod:`anyspeed.inference.resume`).
        Under lock-step decoding every rank takes every turn (a rank with no row left
        decodes a stand-in), as expert parallelism across replicas needs."""
        out = Trajectories(
            tokens=[list(t) for t in tokens],
            logps=[list(x) for x in logps],
            masks=[[1] * len(t) for t in tokens],
            last=[0] * len(tokens),
        )
        out.stats.samples = len(tokens)
        active = [i for i in range(len(tokens)) if parse_calls(self.text(tokens[i]))]
        batch = list(range(len(tokens)))  # the rows of the last sampled batch, in order
        for turn in range(1, self.max_turns + 1):
            if not anyone(bool(active), req.lockstep):
                break
            active = self.add_tool_turns(out, prompts, active)
            if not active and not req.lockstep:
                break
            rows = active or [0]  # lock-step: a stand-in row keeps this rank in step
            if kept is not None:
                kept.rows = [batch.index(i) for i in rows] if active else None
            new, lps = sample(
                [prompts[i] + out.tokens[i] for i in rows],
                self.next_request(req, rows, turn),
                kept=kept,
            )
            batch = rows
            for i, t, lp in zip(active, new, lps, strict=False):
                room = self.max_response - len(out.tokens[i])
                out.tokens[i] += t[:room]
                out.logps[i] += lp[:room]
                out.masks[i] += [1] * len(t[:room])
            active = [i for i in active if parse_calls(self.text(out.tokens[i][out.last[i] :]))]
        out.stats.resumed = kept.resumed if kept is not None else 0
        return out

    def add_tool_turns(
        self, out: Trajectories, prompts: list[list[int]], active: list[int]
    ) -> list[int]:
        """Run the calls of each active row's last turn and append the tool turn to the rows
        it fits; the rows that go on."""
        if not active:
            return []
        answers = run_on_first_rank(self.answer_all, out, active)
        for got in answers:
            out.stats.add(got)
        suffixes = {i: self.tool_turn(got) for i, got in zip(active, answers, strict=True)}
        active = [i for i in active if self.fits(prompts[i], out.tokens[i], suffixes[i])]
        for i in active:
            out.tokens[i] += suffixes[i]
            out.logps[i] += [0.0] * len(suffixes[i])
            out.masks[i] += [0] * len(suffixes[i])
            out.last[i] = len(out.tokens[i])
        return active

    def answer_all(self, out: Trajectories, rows: list[int]) -> list[list[Answer]]:
        """The tools' answers to each row's last turn's calls."""
        return [
            [self.toolbox.answer(c) for c in parse_calls(self.text(out.tokens[i][out.last[i] :]))]
            for i in rows
        ]

    def fits(self, prompt: list[int], answer: list[int], suffix: list[int]) -> bool:
        """Whether a tool turn leaves the answer within its budget and the sequence within the
        context, with room for at least one more sampled token."""
        n = len(answer) + len(suffix)
        return n < self.max_response and len(prompt) + n < self.max_length

    def next_request(self, req: Any, rows: list[int], turn: int) -> Any:
        """The request of a continuation: each row's own generator, renewed per turn."""
        seeds = None
        if req.row_seeds:
            seeds = tuple((req.row_seeds[i] * 31 + turn) % 2**62 for i in rows)
        return replace(req, row_seeds=seeds, max_new_tokens=self.max_response)

    def text(self, ids: list[int]) -> str:
        """A turn's text without its end-of-turn token."""
        from anyspeed.inference.generate import decode

        return decode(self.tok, ids[:-1] if ids and ids[-1] in self.eos else ids)

    def tool_turn(self, answers: list[Answer]) -> list[int]:
        """The tokens the chat template puts between an assistant turn that called tools and
        the next assistant turn: the tool messages, opened and closed as it renders them."""
        name = answers[0].name if answers else "tool"
        calls = [{"type": "function", "function": {"name": name, "arguments": {}}}]
        before = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": calls},
        ]
        tools = [{"role": "tool", "name": a.name or "tool", "content": a.text} for a in answers]
        head = self.tok.render_chat(before, add_generation_prompt=False)
        full = self.tok.render_chat(before + tools, add_generation_prompt=True)
        head = head[: self._turn_end(head)]
        if not full.startswith(head):
            raise RuntimeError("the chat template renders an assistant turn differently")
        return [int(t) for t in self.tok.encode([full[len(head) :]], special=False)[0]]

    def _turn_end(self, text: str) -> int:
        """Where the last end-of-turn token of ``text`` ends (the whole text without one)."""
        from anyspeed.inference.generate import decode

        ends = [decode(self.tok, [e]) for e in self.eos]
        at = max((text.rfind(e) + len(e) for e in ends if e and e in text), default=len(text))
        return at


def anyone(flag: bool, everywhere: bool = True) -> bool:
    """``flag``, or with ``everywhere`` whether it holds on any rank (all ranks take part)."""
    if not everywhere:
        return flag
    import torch.distributed as dist

    from anyspeed.device import torch_device

    t = torch.tensor([int(flag)], device=torch_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def run_on_first_rank(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the first rank of this rank's model-parallel group, its result broadcast
    to the group (tools run once per replica; every rank continues the same sequences)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        return fn(*args)
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return fn(*args)
    box = [fn(*args) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


@dataclass(frozen=True)
class ToolConfig:
    """The checked tool flags."""

    names: tuple[str, ...]
    max_turns: int
    max_chars: int
    side: str
    timeout: float

    def toolbox(self) -> Toolbox:
        return Toolbox(list(self.names), self.timeout, self.max_chars, self.side)


def add_arguments(g: Any) -> None:
    """The multi-turn flags (MindSpeed-RL's names where it has them)."""
    from anyspeed.stages.common.rl.tools import BUILTINS, SIDES

    a = g.add_argument
    a(
        "--tools",
        nargs="+",
        default=None,
        help=f"tools the policy may call in its rollouts: {', '.join(BUILTINS)} or "
        "module:function (typed, with an Args: docstring); turns rollouts multi-turn",
    )
    a("--max-tool-calls", type=int, default=4, help="tool turns per sample at most")
    a(
        "--max-tool-response-length",
        type=int,
        default=512,
        help="characters of a tool's answer kept (the rest cut at --tool-response-truncate-side)",
    )
    a(
        "--tool-response-truncate-side",
        choices=SIDES,
        default="left",
        help="left keeps the answer's beginning, right its end, middle both",
    )
    a("--tool-timeout", type=float, default=10.0, help="seconds a tool call may take")
    a("--tool-parser-format", choices=("hermes",), default="hermes", help="how calls are written")


def from_args(args: Any) -> ToolConfig | None:
    """The tool flags, checked (the tools imported and their schemas made now); None
    without ``--tools``."""
    from anyspeed.errors import UsageError

    if not args.tools:
        return None
    if args.max_tool_calls < 1 or args.max_tool_response_length < 1 or args.tool_timeout <= 0:
        raise UsageError(
            "--max-tool-calls and --max-tool-response-length must be at least 1 and "
            "--tool-timeout above 0"
        )
    cfg = ToolConfig(
        tuple(args.tools),
        args.max_tool_calls,
        args.max_tool_response_length,
        args.tool_response_truncate_side,
        args.tool_timeout,
    )
    cfg.toolbox()  # UsageError naming a tool that cannot be imported or described
    return cfg


def tool_turns(cfg: Any, run: Any, eos: tuple[int, ...]) -> Any:
    """The multi-turn loop of a run with ``--tools`` (None without); the tool turns are the
    tokenizer's chat template's, so it must have one."""
    if cfg.tools is None:
        return None
    from anyspeed.errors import UsageError

    if not run.tokenizer.has_chat_template:
        raise UsageError(
            f"--tools: tokenizer {run.tokenizer.name!r} has no chat template to render tool "
            "turns with; use a tokenizer that has one (e.g. an instruct model's)"
        )
    t = cfg.tools
    return ToolTurns(
        run.tokenizer, t.toolbox(), eos, t.max_turns, cfg.max_response, run.args.seq_length
    )
