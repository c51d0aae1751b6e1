"""``anyspeed posttrain`` runs inside spawned ranks (importable by name for spawn)."""

from __future__ import annotations


def posttrain(cli: list[str]) -> dict:
    """Run ``anyspeed posttrain`` with ``cli`` in this rank; its history (no trainer)."""
    from anyspeed.training.posttrain import prepare, train

    args, _ = prepare(cli)
    history = train(args)
    history.pop("trainer")
    return history


def posttrain_many(clis: list[list[str]]) -> list[dict]:
    """:func:`posttrain` for each command line in turn in one process group; the adaptor is
    re-applied with each case's flags (context parallelism is a feature)."""
    from anyspeed import adaptor

    out = []
    for cli in clis:
        adaptor.undo()
        adaptor.apply(argv=cli)
        out.append(posttrain(cli))
    return out
