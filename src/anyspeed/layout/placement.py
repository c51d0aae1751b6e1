"""Which decoder layers each pipeline stage holds: even shares, uneven first and last stages,
DualPipeV's V and MindSpeed's noop layers, worked out in one place that the model build, the
memory estimate and the converter all read.

A noop layer (``--noop-layers``) is an empty slot that ``--num-layers`` counts: it moves the
stage boundaries (a DeepSeek-V3 of 61 layers runs as 64 slots on 8 or 16 stages) and computes
nothing. Here it is placement only: the real layers keep their numbers 0..N-1, so checkpoints,
Hugging Face conversion and layer patterns (MoE, windows) do not depend on it.
"""

from __future__ import annotations

from collections.abc import Iterable


def split(
    num_layers: int, stages: int, first: int | None, last: int | None, flags: str
) -> list[int]:
    """``num_layers`` over ``stages`` stages: the first and last as given, the middle ones an
    equal share of the rest (at least one layer each); ValueError (one line) otherwise."""
    fixed = [x for x in (first, last) if x is not None]
    rest, others = num_layers - sum(fixed), stages - len(fixed)
    if (
        any(x < 1 for x in fixed)
        or rest < others
        or (others and rest % others)
        or (not others and rest)
    ):
        raise ValueError(
            f"{flags}: {first}/{last} cannot split --num-layers {num_layers} over {stages} "
            "stages (the middle stages take equal shares of the rest, at least one layer)"
        )
    counts = [rest // others if others else 0] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def parse_noop_layers(value: str | Iterable[int] | None) -> tuple[int, ...]:
    """MindSpeed's ``--noop-layers "i,j"`` (0-based slots of ``--num-layers``) as a sorted
    tuple; ValueError (one line) for anything but distinct whole numbers >= 0."""
    if value is None or value == "":
        return ()
    parts = str(value).split(",") if isinstance(value, str) else [str(v) for v in value]
    parts = [p.strip() for p in parts]
    if not all(p.isdigit() for p in parts):
        raise ValueError(
            f"--noop-layers {value!r}: give 0-based layer indices, comma-separated "
            "(counted in --num-layers, e.g. --num-layers 64 --noop-layers 61,62,63)"
        )
    out = sorted(int(p) for p in parts)
    if len(set(out)) != len(out):
        raise ValueError(f"--noop-layers {value!r} names a layer twice: name each once")
    return tuple(out)


def check_noop_layers(noop: tuple[int, ...], real_layers: int) -> None:
    """ValueError (one line) unless every noop slot lies among the ``real_layers + len(noop)``
    slots of ``--num-layers`` and at least one real layer is left."""
    slots = real_layers + len(noop)
    if noop and noop[-1] >= slots:
        raise ValueError(
            f"--noop-layers {noop[-1]}: the {slots} layer slots (--num-layers, noop ones "
            f"counted) are numbered 0 to {slots - 1}"
        )
    if noop and real_layers < 1:
        raise ValueError(
            f"--noop-layers leaves no real layer of --num-layers {slots}: raise --num-layers"
        )


def without_noop(slot_counts: list[int], noop: tuple[int, ...]) -> list[int]:
    """Real layers per stage, given each stage's slots in order and the noop slots."""
    out, start = [], 0
    for count in slot_counts:
        out.append(count - sum(start <= i < start + count for i in noop))
        start += count
    return out
