"""Remove-padding and dynamic batch size for the RL stages (MindSpeed-RL's ``use_remove_padding``,
``use_dynamic_bsz``, ``max_packing_token_size``): a rollout's sequences reach the model laid
end to end as one ``thd`` sequence per micro-batch, so no padding is computed, and with a
dynamic batch size each optimizer step's sequences are split into micro-batches by a token
budget (as evenly as a longest-first greedy split makes them) instead of by count.

The losses read the same padded per-token tensors as without packing
(:mod:`anyspeed.training.packed_rows` puts the model's outputs back in rows), and every loss
is a sum over tokens or sequences divided once by a global count, so the update is the same
(``micro-token-mean``, a mean per micro-batch, changes with the micro-batches by definition).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from anyspeed.errors import UsageError


@dataclass(frozen=True)
class Packing:
    """The checked packing flags."""

    budget: int | None  # tokens per micro-batch (dynamic batch size); None: --micro-batch-size
    multiple: int  # a packed sequence's length is a multiple of this (sequence parallelism)
    common: bool  # every packed sequence of a rollout has one length (PP, EP: fixed shapes)
    equal_counts: bool  # every replica runs as many micro-batches a step (EP's exchanges)


def add_arguments(g: Any) -> None:
    a = g.add_argument
    a(
        "--use-remove-padding",
        action="store_true",
        help="each micro-batch's sequences reach the model as one packed (thd) sequence: no "
        "padding is computed (needs --optimization-level 1 or higher)",
    )
    a(
        "--use-dynamic-bsz",
        action="store_true",
        help="with --use-remove-padding: split each step's sequences into micro-batches of at "
        "most --max-packing-token-size tokens (balanced) instead of --micro-batch-size each",
    )
    a(
        "--max-packing-token-size",
        type=int,
        default=None,
        help="with --use-dynamic-bsz: tokens per micro-batch at most (default: 2 x --seq-length)",
    )


def from_args(
    args: argparse.Namespace, least: int | None = None, default: int | None = None
) -> Packing | None:
    """The packing of a run, checked (one line for a flag that cannot work); None: padded.
    ``least``: the fewest tokens a budget may hold (a sequence: ``--seq-length``; the pairwise
    stages: a pair), ``default``: the budget without ``--max-packing-token-size``."""
    remove, dynamic = args.use_remove_padding, getattr(args, "use_dynamic_bsz", False)
    budget = getattr(args, "max_packing_token_size", None)
    if not remove:
        if dynamic or budget is not None:
            raise UsageError(
                "--use-dynamic-bsz and --max-packing-token-size pack sequences: add "
                "--use-remove-padding"
            )
        return None
    if budget is not None and not dynamic:
        raise UsageError("--max-packing-token-size is the --use-dynamic-bsz budget: add that flag")
    check_packed_attention(args)
    if dynamic:
        least = least or args.seq_length
        budget = (default or 2 * args.seq_length) if budget is None else budget
        if budget < least:
            seq = args.seq_length
            what = "--seq-length" if least == seq else f"2 x --seq-length {seq} ="
            fits = "a sequence" if least == seq else "a pair of sequences"
            raise UsageError(
                f"--max-packing-token-size {budget} is below {what} {least}: {fits} must fit "
                "one micro-batch"
            )
    pp, ep = args.pipeline_model_parallel_size, args.expert_model_parallel_size
    return Packing(
        budget if dynamic else None,
        8 * args.tensor_model_parallel_size,
        pp > 1 or ep > 1,
        ep > 1 and dynamic,
    )


def at_cp1(
    args: argparse.Namespace, stage: str, least: int | None = None, default: int | None = None
) -> Packing | None:
    """:func:`from_args` for a stage whose packed sequences run at CP 1 only (the instruction
    and pairwise stages): a CP > 1 run with ``--use-remove-padding`` is one line."""
    if args.use_remove_padding and args.context_parallel_size > 1:
        raise UsageError(
            f"--stage {stage} --use-remove-padding with --context-parallel-size > 1 is not "
            "supported; use CP 1 or drop --use-remove-padding"
        )
    return from_args(args, least, default)


def pack_step(
    micro: list[dict[str, Any]], sizes: list[list[int]], packing: Packing, limit: int
) -> None:
    """Each padded micro-batch of a step (its rows' real lengths in ``sizes``) also packed
    for the model, at its own length or, where stages or replicas exchange fixed shapes, at
    one length for all (at most ``limit`` tokens)."""
    from anyspeed.training.packed_rows import pack

    for b, n, k in zip(micro, sizes, packed_length(sizes, packing, limit), strict=True):
        pack(b, n, k)


def check_packed_attention(args: argparse.Namespace) -> None:
    """What ``--use-remove-padding`` needs of the model, one line each: packed attention
    (level 1) and layers that restart at each sequence."""
    from anyspeed.features.base import level_of

    if level_of(args) < 1:
        raise UsageError(
            "--use-remove-padding needs the flash-attention feature (attention within each "
            "packed sequence): use --optimization-level 1 or higher"
        )
    if getattr(args, "experimental_attention_variant", None):
        raise UsageError(
            f"--use-remove-padding with --experimental-attention-variant "
            f"{args.experimental_attention_variant}: its layers do not restart at sequence "
            "boundaries; drop --use-remove-padding"
        )


def split(lengths: list[int], budget: int, at_least: int = 1) -> list[list[int]]:
    """Indices of ``lengths`` in micro-batches of at most ``budget`` tokens each, as few as
    fit (and ``at_least``), balanced: longest first, each to the lightest micro-batch.
    Each micro-batch keeps its sequences in their order."""
    if any(n > budget for n in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the budget {budget}")
    k = max(at_least, -(-sum(lengths) // budget), 1)
    while True:
        loads, parts = [0] * k, [[] for _ in range(k)]
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            j = min(range(k), key=lambda j: (loads[j], j))
            loads[j] += lengths[i]
            parts[j].append(i)
        if max(loads) <= budget:
            return [sorted(p) for p in parts if p]
        k += 1


def groups(lengths: list[int], per_step: int, mbs: int, packing: Packing | None) -> list[list[int]]:
    """The rollout's micro-batches as index lists, step by step (``per_step`` sequences a
    step): ``mbs`` consecutive sequences each, or with a dynamic batch size each step split by
    its token budget (every replica as many micro-batches a step when ``equal_counts``)."""
    if packing is None or packing.budget is None:
        return [list(range(i, min(i + mbs, len(lengths)))) for i in range(0, len(lengths), mbs)]
    steps = [list(range(i, i + per_step)) for i in range(0, len(lengths), per_step)]
    budget = packing.budget
    parts = [split([lengths[i] for i in s], budget) for s in steps]
    if packing.equal_counts:
        most = _max_over_ranks([len(p) for p in parts])
        parts = [
            split([lengths[i] for i in s], budget, k) for s, k in zip(steps, most, strict=True)
        ]
    return [[s[i] for i in p] for s, part in zip(steps, parts, strict=True) for p in part]


def packed_length(lengths: list[list[int]], packing: Packing, limit: int) -> list[int]:
    """Each micro-batch's packed sequence length: its tokens rounded up to the multiple, or
    under ``common`` the longest of the rollout's on every rank (at most ``limit``, the most a
    micro-batch can hold, rounded up)."""
    m = packing.multiple
    own = [-(-sum(n) // m) * m for n in lengths]
    if not packing.common:
        return own
    cap = -(-limit // m) * m
    common = min(cap, _max_over_ranks([max(own)])[0])
    return [common] * len(own)


def _max_over_ranks(values: list[int]) -> list[int]:
    """Element-wise maximum of ``values`` over every rank."""
    import torch
    import torch.distributed as dist

    from anyspeed.device import torch_device

    t = torch.tensor(values, dtype=torch.int64, device=torch_device())
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(x) for x in t.tolist()]
