"""The task interface the next stages build on, at DP2, TP2 and PP2 in one spawned pair of
ranks: the shared per-token log-prob forward equals log_softmax of the gathered logits (all
rows, and the real vocabulary without the padded ones); a frozen checkpoint copy keeps the
weights it was given while the policy trains; LoRA's adapters-off view is the untouched base;
named metrics are global ratios or DP means; generation between steps equals a no-cache greedy
decode of the same weights and hands the model back in training mode."""

from __future__ import annotations

import pytest

from anyspeed.testing import run_distributed
from helpers import task_ranks

CASES = [(1, 1), (2, 1), (1, 2)]  # on 2 ranks: DP2, TP2, PP2
TOL = 1e-5  # fp32


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    d = tmp_path_factory.mktemp("task-interface")
    return run_distributed(task_ranks.layouts, 2, ckpt_dir=str(d), cases=CASES, timeout=400)


def _last(ranks: list[dict], case) -> dict:
    """The rank that holds the last pipeline stage's outputs (rank 1 under PP2)."""
    return ranks[1][case] if case[1] > 1 else ranks[0][case]


@pytest.mark.parametrize("case", CASES, ids=["dp2", "tp2", "pp2"])
def test_logprob_forward_equals_log_softmax(ranks, case):
    r = _last(ranks, case)
    assert r["logprob_diff"] < TOL
    assert r["real_vocab_diff"] < TOL


@pytest.mark.parametrize("case", CASES, ids=["dp2", "tp2", "pp2"])
def test_frozen_copy_keeps_its_weights(ranks, case):
    r = _last(ranks, case)
    assert r["frozen_diff"] < TOL < r["trained_moved"]


@pytest.mark.parametrize("case", CASES, ids=["dp2", "tp2", "pp2"])
def test_lora_reference_is_the_base(ranks, case):
    r = _last(ranks, case)["lora"]
    assert r["base_diff"] < TOL < r["trained_moved"]


@pytest.mark.parametrize("case", CASES, ids=["dp2", "tp2", "pp2"])
def test_named_metrics_reach_the_step(ranks, case):
    for rank in ranks:  # every rank sees the same reduced values
        m, loss = rank[case]["metrics"], rank[case]["loss"]
        assert set(m) == {"nll", "label mean"}
        # Unmasked tokens in equal micro-batches: the global token mean is the loss.
        assert m["nll"] == pytest.approx(loss, rel=1e-6)
    # The scalar is averaged over micro-batches and DP replicas: the global batch's mean.
    want = [r[case]["label_mean_ref"] for r in ranks]
    got = ranks[0][case]["metrics"]["label mean"]
    assert got == pytest.approx(sum(want) / len(want) if case == (1, 1) else want[0], rel=1e-9)


@pytest.mark.parametrize("case", CASES, ids=["dp2", "tp2", "pp2"])
def test_generation_between_steps(ranks, case):
    for rank in ranks:
        g = rank[case]["generate"]
        assert g["agree"] == [True, True] and g["train_mode_after"] == [True, True]
