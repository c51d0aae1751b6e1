"""DPO at every layout the SFT stage runs: the answers' log-prob sums equal transformers' at
TP2+SP, PP2 and CP2, and the loss and grad norm of 4 steps at TP2, PP2, DP2 (distributed
optimizer) and CP2 equal one process's within 1e-5."""

from __future__ import annotations

import math

import pytest
from test_dpo import TOL, cli, hf_pair_logps, mean

from anyspeed.testing import run_distributed
from helpers import sft_ranks

LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "cp2": ["--context-parallel-size", "2"],
    "dp2": ["--use-distributed-optimizer"],
}


@pytest.fixture(scope="module")
def runs(pair_data, tiny_qwen) -> dict[str, dict]:
    """4 steps at one process and at each two-rank layout."""
    one = cli(tiny_qwen, pair_data, iters=4)
    ref = run_distributed(sft_ranks.posttrain, 1, argv=one, cli=one, timeout=300)[0]
    argvs = [cli(tiny_qwen, pair_data, *flags, iters=4) for flags in LAYOUTS.values()]
    out = run_distributed(sft_ranks.posttrain_many, 2, argv=argvs[0], clis=argvs, timeout=600)
    return {"one": ref, **{name: out[0][i] for i, name in enumerate(LAYOUTS)}}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logps_equal_transformers(layout, runs, pair_data, tiny_qwen):
    pc, pr, _, _ = hf_pair_logps(tiny_qwen, pair_data)
    m = runs[layout]["metrics"]
    assert runs[layout]["loss"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert m["logps/chosen"][0] == pytest.approx(mean(pc), rel=TOL)
    assert m["logps/rejected"][0] == pytest.approx(mean(pr), rel=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_and_grad_norm_equal_one_process(layout, runs):
    assert runs[layout]["loss"] == pytest.approx(runs["one"]["loss"], rel=TOL)
    assert runs[layout]["grad_norm"] == pytest.approx(runs["one"]["grad_norm"], rel=TOL)
    got, want = runs[layout]["metrics"], runs["one"]["metrics"]
    assert got["rewards/margins"] == pytest.approx(want["rewards/margins"], rel=TOL, abs=1e-6)
    # step 1's rewards are all 0 (policy = reference): its accuracy is a coin toss of rounding
    assert got["rewards/accuracies"][1:] == want["rewards/accuracies"][1:]
