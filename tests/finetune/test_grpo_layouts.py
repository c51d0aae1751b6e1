"""GRPO at every layout against one process: the same rollout (per-sample seeds), the rollout's
own log-probs equal to the training forward's within 1e-5 (fp32) at TP1, TP2 and PP2, and the
loss and grad norm of 4 steps (two passes over each rollout) equal within 1e-5 at TP2+SP, PP2
and DP2 (distributed optimizer, each replica rolling out half the prompts)."""

from __future__ import annotations

import pytest
from test_grpo import cli

from anyspeed.testing import run_distributed
from helpers import sft_ranks

TOL = 1e-5
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "tp2-sp-lora": [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--lora-target-modules",
        "linear_qkv",
        "linear_fc2",
        "--lora-r",
        "4",
    ],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": ["--use-distributed-optimizer"],
}
RUN = ["--verifier-function", "helpers.user_rewards:vowels", "--ppo-epochs", "2",
       "--lr-decay-style", "constant", "--rollout-batch-size", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(add_prompts, tiny_qwen, hf_tok) -> dict[str, dict]:
    one = cli(tiny_qwen, add_prompts, hf_tok, *RUN, iters=4)
    ref = run_distributed(sft_ranks.posttrain, 1, argv=one, cli=one, timeout=300)[0]
    argvs = [cli(tiny_qwen, add_prompts, hf_tok, *RUN, *flags, iters=4)
             for flags in LAYOUTS.values()]  # fmt: skip
    out = run_distributed(sft_ranks.posttrain_many, 2, argv=argvs[0], clis=argvs, timeout=600)
    return {"one": ref, **{name: out[0][i] for i, name in enumerate(LAYOUTS)}}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one", *LAYOUTS])
def test_rollout_logps_are_the_training_forwards(layout, runs):
    assert max(runs[layout]["metrics"]["rollout/logp_mismatch_max"]) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if "lora" not in n])
def test_loss_and_grad_norm_equal_one_process(layout, runs):
    got, want = runs[layout], runs["one"]
    assert got["metrics"]["grpo/rewards/mean"] == want["metrics"]["grpo/rewards/mean"]
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)


@pytest.mark.slow
def test_moe_at_ep2_equals_one_process(add_prompts, hf_tok, tiny_moe):
    """A Qwen3-MoE model (no reference: beta 0) at EP2 (distributed optimizer; replicas
    decode in lockstep, training on equal shapes) takes the same rollouts, loss and grad norm
    as one process."""
    one = cli(tiny_moe, add_prompts, hf_tok, *RUN, "--init-kl-coef", "0", iters=2)
    ref = run_distributed(sft_ranks.posttrain, 1, argv=one, cli=one, timeout=300)[0]
    from anyspeed.convert import hf_cache as hf_load

    ep = one + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    flags = hf_load.expand(ep, tiny_moe)  # the adaptor sees the MoE architecture flags
    two = run_distributed(sft_ranks.posttrain, 2, argv=flags, cli=ep, timeout=300)[0]
    assert two["metrics"]["grpo/rewards/mean"] == ref["metrics"]["grpo/rewards/mean"]
    assert two["loss"] == pytest.approx(ref["loss"], rel=TOL, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL)


@pytest.mark.slow  # 15 s; test_grpo.py checks the one-rank failure fast (CI time)
def test_a_reward_failing_on_one_rank_stops_every_rank(add_prompts, tiny_qwen, hf_tok):
    from anyspeed.testing import DistributedError

    argv = cli(tiny_qwen, add_prompts, hf_tok, "--verifier-function",
               "helpers.user_rewards:fails_on_rank1")  # fmt: skip
    with pytest.raises(DistributedError) as err:
        run_distributed(sft_ranks.posttrain, 2, argv=argv, cli=argv, timeout=120, fresh=True)
    text = str(err.value)
    assert text.count("RewardError") >= 2 and "rank 1's verifier broke" in text
