"""An RL rollout and the training micro-batches made from it: each sample is its prompt and
answer, right-padded; the labels are the next tokens, learned on the answer only, each answer
token carrying its sequence's advantage and the log-prob the rollout sampled it with. Also the
rollout's global statistics (rewards, lengths, mismatch, timing), the same on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from anyspeed.distributed import pipeline

# the rollout's statistics, in the order global_stats gives them (then TOOL_STATS with tools)
STATS = (
    "grpo/rewards/mean",
    "grpo/rewards/min",
    "grpo/rewards/max",
    "response_length/mean",
    "response_length/min",
    "response_length/max",
    "grpo/zero_adv_groups",
    "grpo/kept_groups",
    "rollout/logp_mismatch",
    "rollout/logp_mismatch_max",
    "timing/rollout",
    "timing/old_log_p",
    "timing/reference_model",
    "rollout_tps",
    "timing/reshard",
)
TOOL_STATS = ("tools/calls_per_sample", "tools/errors", "tools/timeouts", "tools/time")


@dataclass
class Group:
    """One prompt's samples."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    logps: list[list[float]]
    rewards: torch.Tensor
    advantages: torch.Tensor
    masks: list[list[int]] | None = None  # 1: the model's token, 0: a tool turn's
    token_rewards: list[list[float]] | None = None  # per answer token (a PRM's step rewards)
    token_advantages: list[list[float]] | None = None  # per answer token (GRPO's steps)

    def has_signal(self) -> bool:
        """Whether the rewards (or the steps' token rewards or advantages) differ: else zero
        advantage, no gradient."""
        if self.token_advantages is not None and any(any(a) for a in self.token_advantages):
            return True
        steps = self.token_rewards
        if steps is not None and any(r != steps[0] for r in steps):
            return True
        return bool((self.rewards != self.rewards[0]).any())


@dataclass
class Rollout:
    """This replica's samples, ``group`` consecutive ones per prompt."""

    prompts: list[list[int]]
    tokens: list[list[int]]  # the answers (ending with the EOS when one was sampled)
    logps: list[list[float]]  # the rollout's own log-prob of each answer token
    rewards: torch.Tensor
    advantages: torch.Tensor
    group: int
    kept: int  # groups with a reward signal (--filter-groups), else all
    masks: list[list[int]] | None = None  # per answer token, 1: the model's, 0: a tool turn's
    token_rewards: list[list[float]] | None = None  # per answer token (a PRM's step rewards)
    token_advantages: list[list[float]] | None = None  # per answer token, in place of one each

    def groups(self) -> list[Group]:
        g = self.group
        return [
            Group(
                self.prompts[i : i + g],
                self.tokens[i : i + g],
                self.logps[i : i + g],
                self.rewards[i : i + g],
                self.advantages[i : i + g],
                self.masks[i : i + g] if self.masks is not None else None,
                _part(self.token_rewards, i, g),
                _part(self.token_advantages, i, g),
            )
            for i in range(0, len(self.tokens), g)
        ]

    def model_tokens(self) -> list[int]:
        """Each answer's length without tool turns (the tokens the model sampled)."""
        if self.masks is None:
            return [len(t) for t in self.tokens]
        return [sum(m) for m in self.masks]

    @classmethod
    def join(cls, groups: list[Group], want: int, kept: int) -> Rollout:
        groups = groups[:want]
        return cls(
            [p for x in groups for p in x.prompts],
            [t for x in groups for t in x.tokens],
            [lp for x in groups for lp in x.logps],
            torch.cat([x.rewards for x in groups]),
            torch.cat([x.advantages for x in groups]),
            len(groups[0].tokens),
            min(kept, want),
            None if groups[0].masks is None else [m for x in groups for m in x.masks or []],
            _joined([x.token_rewards for x in groups]),
            _joined([x.token_advantages for x in groups]),
        )


def _part(rows: list | None, i: int, g: int) -> list | None:
    return rows[i : i + g] if rows is not None else None


def _joined(parts: list[list | None]) -> list | None:
    return None if parts[0] is None else [r for p in parts for r in p or []]


def _length(longest: int, args: Any, packing: Any = None) -> int:
    """The micro-batches' sequence length: --seq-length under pipeline parallelism (fixed
    shapes) and expert parallelism (replicas exchange tokens: the same shapes), else the
    rollout's longest rounded up for TP/SP. Packed, the model never reads these rows: the
    longest."""
    if packing is not None:
        return longest
    if args.pipeline_model_parallel_size > 1 or args.expert_model_parallel_size > 1:
        return args.seq_length
    multiple = 8 * args.tensor_model_parallel_size
    return min(args.seq_length, -(-longest // multiple) * multiple)


def micro_batches(
    roll: Rollout, args: Any, pad: int, device: torch.device, packing: Any = None
) -> list[dict[str, Any]]:
    """The rollout's sequences in order, on ``device``: ``--micro-batch-size`` per
    micro-batch, or split by tokens under a dynamic batch size (``packing``, a
    :class:`~.packing.Packing`: each micro-batch also packed for the model). Each carries
    ``step``, the optimizer step of the rollout it belongs to."""
    from anyspeed.stages.common.rl import packing as P
    from anyspeed.training.packed_rows import pack

    n = len(roll.tokens)
    sizes = [len(p) + len(t) for p, t in zip(roll.prompts, roll.tokens, strict=True)]
    rows = _rows(roll, _length(max(sizes), args, packing), pad)
    per_step = _per_step(args, n)
    parts = P.groups(sizes, per_step, args.micro_batch_size, packing)
    if packing is not None:
        limit = packing.budget or args.micro_batch_size * args.seq_length
        lengths = P.packed_length([[sizes[i] for i in g] for g in parts], packing, limit)
    out = []
    for k, idx in enumerate(parts):
        at = torch.tensor(idx)
        span = max(sizes[i] for i in idx) if packing is not None else rows["tokens"].shape[1]
        b = {key: v[at, :span] if v.dim() > 1 else v[at] for key, v in rows.items()}
        b = {key: v.contiguous().to(device) for key, v in b.items()}
        if packing is not None:
            pack(b, [sizes[i] for i in idx], lengths[k])
        b["step"] = idx[0] // per_step
        out.append(b)
    return out


def _per_step(args: Any, n: int) -> int:
    """Sequences per optimizer step on this replica (all ``n`` outside a training run)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return n
    return max(1, min(n, args.global_batch_size // ps.get_data_parallel_world_size()))


def _rows(roll: Rollout, length: int, pad: int) -> dict[str, torch.Tensor]:
    """Every sequence of the rollout as one padded row of ``length``: tokens, next-token
    labels, the answer mask, advantages, the rollout's log-probs (and step rewards)."""
    n = len(roll.tokens)
    tokens = torch.full((n, length), pad, dtype=torch.int64)
    labels = torch.zeros((n, length), dtype=torch.int64)
    mask = torch.zeros((n, length))
    old = torch.zeros((n, length))
    step = torch.zeros((n, length)) if roll.token_rewards is not None else None
    adv = roll.advantages.float()[:, None].expand(n, length).clone()
    for i, (p, t, lp) in enumerate(zip(roll.prompts, roll.tokens, roll.logps, strict=True)):
        seq = torch.tensor((p + t)[:length])
        tokens[i, : len(seq)] = seq
        labels[i, : len(seq) - 1] = seq[1:]
        first, last = len(p) - 1, min(len(p) + len(t), length) - 1  # label positions
        mask[i, first:last] = (
            1 if roll.masks is None else torch.tensor(roll.masks[i][: last - first])
        )
        old[i, first:last] = torch.tensor(lp[: last - first])
        if step is not None and roll.token_rewards is not None:
            step[i, first:last] = torch.tensor(roll.token_rewards[i][: last - first])
        if roll.token_advantages is not None:
            adv[i, first:last] = torch.tensor(roll.token_advantages[i][: last - first])
    out = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": mask,
        "position_ids": torch.arange(length).expand(n, length),
        "advantages": adv,
        "scores": roll.rewards.float(),  # each sequence's reward
        "rollout_logp": old,
    }
    if step is not None:  # each answer token's own reward, beside its sequence's score
        out["token_rewards"] = step
    return out


def steps_of(micro: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A rollout's micro-batches grouped by the optimizer step they belong to."""
    out: list[list[dict[str, Any]]] = []
    for b in micro:
        if not out or out[-1][0]["step"] != b["step"]:
            out.append([])
        out[-1].append(b)
    return out


def scoring_batches(
    prompts: list[list[int]], answers: list[list[int]], args: Any, pad: int
) -> list[dict[str, Any]]:
    """(prompt, answer) sequences as a reward model reads them: micro-batches made as the
    rollout's are (no log-probs, rewards or advantages), on this process's device."""
    from anyspeed.device import torch_device

    zero = torch.zeros(len(answers), dtype=torch.float64)
    roll = Rollout(prompts, answers, [[0.0] * len(a) for a in answers], zero, zero, 1, 0)
    return micro_batches(roll, args, pad, torch_device())


def mismatch(micro: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(sum, count, max) of |recomputed - rollout| log-prob over this replica's answer tokens,
    counted once per replica (the last stage's first tensor-parallel rank); zeros elsewhere."""
    from megatron.core import parallel_state as ps

    if not pipeline.is_output_stage() or ps.get_tensor_model_parallel_rank():
        return 0.0, 0.0, 0.0
    total, count, most = 0.0, 0.0, 0.0
    for b in micro:
        mask = b.get("answer_mask", b["loss_mask"])  # before any rollout-correction rejection
        diff = (b["old_logp"] - b["rollout_logp"]).abs() * mask
        total += float(diff.double().sum())
        count += float(mask.sum())
        most = max(most, float(diff.max()))
    return total, count, most


def global_stats(
    roll: Rollout,
    mm: tuple[float, float, float],
    clock: Any,
    device: torch.device,
    tools: Any = None,
) -> torch.Tensor:
    """The rollout's statistics over every replica, in :data:`STATS` order, then with
    ``tools`` (this replica's :class:`~.multiturn.ToolStats`) :data:`TOOL_STATS`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    lengths = torch.tensor([float(n) for n in roll.model_tokens()], dtype=torch.float64)
    zero = sum(not g.has_signal() for g in roll.groups())
    first = pipeline.is_output_stage() and not (ps.get_tensor_model_parallel_rank())
    k = float(first)  # each replica's counts once
    tool_sums = [tools.calls, tools.samples, tools.errors, tools.timeouts] if tools else []
    sums = torch.tensor(
        [
            k * float(roll.rewards.sum()),
            k * len(roll.rewards),
            k * float(lengths.sum()),
            k * zero,
            k * len(roll.groups()),
            k * roll.kept,
            mm[0],
            mm[1],
            k * float(sum(roll.model_tokens())),
            *(k * x for x in tool_sums),
        ],
        dtype=torch.float64,
        device=device,
    )
    most = torch.tensor(
        [
            float(roll.rewards.max()),
            -float(roll.rewards.min()),
            float(lengths.max()),
            -float(lengths.min()),
            mm[2],
            clock.rollout,
            clock.old,
            clock.ref,
            clock.reshard,
            *([tools.seconds] if tools else []),
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(sums)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    s, m = sums.tolist(), most.tolist()
    n, groups = max(s[1], 1.0), max(s[4], 1.0)
    return torch.tensor(
        [
            s[0] / n,
            -m[1],
            m[0],
            s[2] / n,
            -m[3],
            m[2],
            s[3] / groups,
            s[5] / groups,
            s[6] / max(s[7], 1.0),
            m[4],
            m[5],
            m[6],
            m[7],
            s[8] / max(m[5], 1e-9),
            m[8],
            *([s[9] / max(s[10], 1.0), s[11], s[12], m[9]] if tools else []),
        ],
        device=device,
    )
