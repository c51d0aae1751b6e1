"""DualPipeV's order of work on each pipeline rank, as plain data.

DualPipeV ("cut-in-half" DualPipe, DeepSeek-V3's schedule) gives each of the ``P`` pipeline
ranks two model chunks in a V: rank ``r`` holds stage ``r`` (chunk 0, on the way down) and stage
``2P - 1 - r`` (chunk 1, on the way back up). The last rank hands chunk 0's output to its own
chunk 1, and rank 0 holds both the embedding and the loss. Each rank runs its micro-batches in
eight phases: warm-up forwards, then forwards and backwards of the two chunks interleaved, then
the remaining backwards; with ``M >= 2P`` micro-batches the steady phase alternates
(F0, B1, F1, B0), so each rank keeps at most ``2P + 1`` chunks' activations alive.

The plan is pure data so it can be checked without processes: :func:`simulate` runs every
rank's plan against the messages the others send, finds a deadlock if there is one, and gives
the step's length in compute units (the pipeline bubble) for given forward/backward costs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One unit of work on ``chunk`` (0 or 1) and micro-batch ``microbatch``: ``kind`` "F"
    (forward), "B" (backward: input and weight gradients), "I" (backward of the input
    gradients only; the weight gradients are queued) or "W" (the oldest queued weight
    gradients, of that "I")."""

    kind: str
    chunk: int
    microbatch: int


def check_microbatches(pp: int, microbatches: int) -> None:
    """ValueError (one line) when a training step has too few micro-batches for DualPipeV."""
    if microbatches < 2 * pp:
        raise ValueError(
            f"--schedules-method dualpipev needs at least 2 x --pipeline-model-parallel-size "
            f"= {2 * pp} micro-batches per step (got {microbatches}): raise --global-batch-size "
            "or lower --micro-batch-size"
        )


def training_plan(pp: int, rank: int, microbatches: int, split: bool = False) -> list[Op]:
    """Rank ``rank``'s forwards and backwards of one training step, in order. ``split``
    (``--dualpipev-dw-detach``): where the schedule would otherwise idle, a backward sends its
    input gradient first and its weight gradients run later ("I" then "W", zero-bubble)."""
    check_microbatches(pp, microbatches)
    p, r, m = pp, rank, microbatches
    ops: list[Op] = []
    done = {"F": [0, 0], "B": [0, 0]}
    queued: list[Op] = []

    def run(kind: str, chunk: int, defer: bool = False) -> None:
        i = done[kind][chunk]
        done[kind][chunk] += 1
        if kind == "B" and defer and split:
            ops.append(Op("I", chunk, i))
            queued.append(Op("W", chunk, i))
        else:
            ops.append(Op(kind, chunk, i))

    def weights() -> None:
        if queued:
            ops.append(queued.pop(0))

    for _ in range(2 * (p - 1 - r)):  # 1: chunk 0 runs ahead, more the further from the V's tip
        run("F", 0)
    for _ in range(r + 1):  # 2: both chunks forward
        run("F", 0), run("F", 1)
    for _ in range(p - 1 - r):  # 3: the first backwards of chunk 1 (their input grads first)
        run("B", 1, defer=True), weights(), run("F", 1)
    for _ in range(m - 2 * p + r + 1):  # 4: steady state
        run("F", 0), run("B", 1), run("F", 1), run("B", 0)
    for _ in range(p - 1 - r):  # 5: no chunk-0 forwards left
        run("B", 1), run("F", 1), run("B", 0)
    h = (r + 1) // 2
    for i in range(r + 1):  # 6: backwards of both chunks; the second half defers weights
        run("B", 1, defer=i > h or (i == h and r % 2 == 1)), run("B", 0, defer=i >= h)
    for _ in range(p - 1 - r):  # 7: the last chunk-0 backwards, weights in between
        weights(), run("B", 0, defer=True)
    while queued:  # 8: the weights left
        weights()
    return ops


def forward_plan(pp: int, rank: int, microbatches: int) -> list[Op]:
    """Rank ``rank``'s forwards of a forward-only pass (any number of micro-batches): every
    chunk-0 forward, then every chunk-1 forward; nothing is kept for a backward."""
    return [Op("F", c, i) for c in (0, 1) for i in range(microbatches)]


def needs(op: Op, pp: int, rank: int) -> tuple[int, Op] | None:
    """The (rank, op) whose output ``op`` on ``rank`` consumes from another rank or from the
    same rank's other chunk; None when it starts from the data or the loss."""
    m, last = op.microbatch, pp - 1
    if op.kind == "W":
        return None
    if op.kind == "F":
        if op.chunk == 0:
            return (rank - 1, Op("F", 0, m)) if rank > 0 else None
        return (rank + 1, Op("F", 1, m)) if rank < last else (rank, Op("F", 0, m))
    if op.chunk == 1:
        return (rank - 1, Op("B", 1, m)) if rank > 0 else None
    return (rank + 1, Op("B", 0, m)) if rank < last else (rank, Op("B", 1, m))


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` finds: the step's length, each rank's busy time (both in compute
    units) and each rank's most chunk activations alive at once (forwards not yet backed)."""

    length: float
    busy: list[float]
    peak_alive: list[int]


def simulate(
    plans: list[list[Op]], forward: float = 1.0, backward: float = 2.0, weight: float = 0.5
) -> Timeline:
    """Run every rank's plan with non-blocking sends and blocking receives, one chunk's
    forward costing ``forward``, its backward ``backward``, of which the weight gradients are
    the share ``weight`` (an "I" costs the rest, a "W" that share). RuntimeError naming the
    stuck ops on a deadlock, and when a backward comes before its own forward."""
    cost = {"F": forward, "B": backward, "I": backward * (1 - weight), "W": backward * weight}
    pp = len(plans)
    finished: dict[tuple[int, Op], float] = {}
    clock, pos = [0.0] * pp, [0] * pp
    alive, peak = [0] * pp, [0] * pp
    while any(pos[r] < len(plans[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(plans[r]):
                op = plans[r][pos[r]]
                dep = needs(op, pp, r)
                own = (r, Op("F" if op.kind != "W" else "I", op.chunk, op.microbatch))
                if op.kind != "F" and own not in finished:
                    raise RuntimeError(f"rank {r}: {op} before its forward (or input grads)")
                if dep is not None and dep not in finished:
                    break
                start = max(clock[r], finished[dep] if dep is not None else 0.0)
                clock[r] = start + cost[op.kind]
                finished[(r, op)] = clock[r]
                if op.kind == "I":  # the input gradient is out: what a "B" would send
                    finished[(r, Op("B", op.chunk, op.microbatch))] = clock[r]
                alive[r] += {"F": 1, "B": -1, "W": -1}.get(op.kind, 0)
                peak[r] = max(peak[r], alive[r])
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = [plans[r][pos[r]] for r in range(pp) if pos[r] < len(plans[r])]
            raise RuntimeError(f"deadlock: ranks wait on {stuck}")
    busy = [sum(cost[op.kind] for op in plan) for plan in plans]
    return Timeline(max(clock), busy, peak)
