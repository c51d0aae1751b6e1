"""DualPipeV's per-rank plans, checked without processes: every micro-batch runs forward and
backward once per chunk in order, the ranks' plans cannot deadlock, and the bubble and the live
activations are what the schedule promises. The references are counted from the plans by a
separate event simulation (``plan.simulate``) and the closed forms of 1F1B."""

from __future__ import annotations

import pytest

from anyspeed.distributed.dualpipev import plan

CASES = [(p, m) for p in (2, 3, 4, 8) for m in range(2 * p, 2 * p + 6)]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("pp", "mbs"), CASES)
def test_every_microbatch_runs_once_per_chunk_in_order(pp, mbs, split):
    for rank in range(pp):
        ops = plan.training_plan(pp, rank, mbs, split)
        for kinds in ("F", "BI"):
            for chunk in (0, 1):
                got = [o.microbatch for o in ops if o.kind in kinds and o.chunk == chunk]
                assert got == list(range(mbs)), (rank, kinds, chunk)
        # each deferred weight gradient runs once, after its input gradients, in order
        deferred = [(o.chunk, o.microbatch) for o in ops if o.kind == "I"]
        assert [(o.chunk, o.microbatch) for o in ops if o.kind == "W"] == deferred
        assert bool(deferred) == split


@pytest.mark.parametrize(("pp", "mbs"), CASES)
def test_plans_run_to_the_end_with_less_bubble_than_1f1b(pp, mbs):
    timeline = plan.simulate([plan.training_plan(pp, r, mbs) for r in range(pp)])
    work = 3.0 * 2 * mbs  # per rank: two chunks, forward 1 + backward 2 each
    assert timeline.busy == [work] * pp
    # 1F1B with the same layers per rank (one chunk of twice the work): (M + P - 1) slots.
    one_f_one_b = (mbs + pp - 1) * 6.0
    assert work <= timeline.length < one_f_one_b
    # At most 2P + 1 chunk activations alive (P + 1/2 of a rank's layers), as DualPipeV's
    # paper states; 1F1B keeps P whole micro-batches on its first rank.
    assert max(timeline.peak_alive) <= 2 * pp + 1


@pytest.mark.parametrize(("pp", "mbs"), CASES)
def test_deferred_weight_gradients_shrink_the_bubble(pp, mbs):
    """--dualpipev-dw-detach: the same work, a bubble at most a third of the plain V's."""
    plain = plan.simulate([plan.training_plan(pp, r, mbs) for r in range(pp)])
    split = plan.simulate([plan.training_plan(pp, r, mbs, True) for r in range(pp)])
    assert split.busy == plain.busy
    work = plain.busy[0]
    assert split.length - work <= (plain.length - work) / 3 + 1e-9


@pytest.mark.parametrize(("pp", "mbs"), [(2, 1), (4, 3), (3, 7)])
def test_forward_only_plans_run_any_number_of_microbatches(pp, mbs):
    timeline = plan.simulate([plan.forward_plan(pp, r, mbs) for r in range(pp)])
    assert timeline.busy == [2.0 * mbs] * pp


def test_simulator_finds_a_deadlock():
    """The check can fail: a rank that takes chunk 1 before chunk 0 waits on itself."""
    plans = [plan.forward_plan(2, r, 2) for r in range(2)]
    plans[1] = list(reversed(plans[1]))
    with pytest.raises(RuntimeError, match="deadlock"):
        plan.simulate(plans)


def test_too_few_microbatches_is_one_line():
    with pytest.raises(ValueError, match=r"at least 2 x --pipeline-model-parallel-size = 8"):
        plan.training_plan(4, 0, 7)
