"""A kept KV cache continued with more tokens (multi-turn rollouts) against the same prompts
read afresh: equal tokens, log-probs within fp32 noise, at TP1, TP2 and PP2, with keys stored
as computed (level 0) and already rotated (``no-grad-fast-path``), for RoPE, learned positions
and a MoE model.

Each later turn continues a subset of the last turn's rows, reordered, then a single row; rows
end at different steps, so the kept cache has slots past a row's end that must not be read. A
key rotated by the wrong number of slots moves the log-probs by ~1e-3 (checked when written),
so 1e-5 tells a misplaced cache from rounding.
"""

from __future__ import annotations

import pytest

from anyspeed.testing import run_distributed
from helpers import resume_ranks

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [30, 12], [8, 9, 10, 11]]
TOL = 1e-5


def _check(res: dict) -> None:
    assert res["resumed"] == len(resume_ranks.ROWS)  # every later turn extended the cache
    for kept, fresh in zip(res["kept"], res["fresh"], strict=True):
        assert kept[0] == fresh[0]
        for a, b in zip(kept[1], fresh[1], strict=True):
            assert a == pytest.approx(b, abs=TOL)


def test_resumed_cache_equals_reading_afresh() -> None:
    (got,) = run_distributed(resume_ranks.turns, 1, argv=["--optimization-level", "1"],
                             layouts=[(1, 1)], prompts=PROMPTS, kinds=["dense"],
                             greedy=False, timeout=300)  # fmt: skip
    _check(got["tp1pp1-dense"])
    # the moved cache keeps the lean step's memory order (each row's slots of a group together)
    assert got["tp1pp1-dense"]["step_order"]


@pytest.mark.slow
@pytest.mark.parametrize("level", ["0", "1"])
def test_resumed_cache_at_every_layout(level: str) -> None:
    ranks = run_distributed(resume_ranks.turns, 2, argv=["--optimization-level", level],
                            layouts=[(1, 1), (2, 1), (1, 2)], prompts=PROMPTS,
                            kinds=["dense", "learned", "moe"], greedy=True,
                            timeout=900)  # fmt: skip
    for res in ranks[0].values():
        _check(res)
    assert ranks[0] == ranks[1]  # every rank has the same tokens and log-probs
