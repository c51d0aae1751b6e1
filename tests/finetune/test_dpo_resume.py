"""Full DPO's reference: a frozen copy without gradients or optimizer state, and resuming a
DPO run keeps the reference it recorded (4 steps straight equal 2, saved, then 2 resumed)."""

from __future__ import annotations

import pytest
from test_dpo import TOL, cli

from anyspeed.testing import run_distributed
from helpers import sft_ranks


def test_reference_has_no_gradients_or_optimizer_state(pair_data, tiny_qwen):
    argv = cli(tiny_qwen, pair_data, iters=1)
    got = run_distributed(sft_ranks.reference_costs, 1, argv=argv, cli=argv, timeout=300)[0]
    assert got["ref_numel"] == got["policy_numel"] > 0
    assert got["requires_grad"] == got["with_grad"] == got["in_optimizer"] == 0
    assert got["policy_in_optimizer"] > 0


def test_resume_keeps_the_recorded_reference(pair_data, tiny_qwen, tmp_path):
    """The resumed run loads the DPO checkpoint as the policy and, from its record, the
    converted HF model (not the DPO checkpoint) as the reference: the losses continue as in
    one run."""
    from anyspeed.convert import hf_cache as hf_load

    ck, const = str(tmp_path / "ck"), ["--lr-decay-style", "constant"]
    straight = cli(tiny_qwen, pair_data, *const, iters=4)
    first = cli(tiny_qwen, pair_data, *const, "--save", ck, "--save-interval", "2", iters=2)
    # the resumed run: --load the DPO checkpoint (no --finetune)
    resumed = hf_load.expand(cli(ck, pair_data, *const, iters=4), tiny_qwen)
    resumed.remove("--finetune")
    runs = run_distributed(sft_ranks.posttrain_many, 1, argv=straight,
                           clis=[straight, first, resumed], timeout=300)[0]  # fmt: skip
    whole, a, b = runs
    assert a["loss"] + b["loss"] == pytest.approx(whole["loss"], rel=TOL)
    assert b["metrics"]["rewards/margins"] == pytest.approx(
        whole["metrics"]["rewards/margins"][2:], rel=TOL, abs=1e-6
    )
