"""GRPO rolling out at another layout than training (``--infer-tensor-parallel-size 1
--infer-pipeline-parallel-size 1``: the whole model on every rank, TP 1 x DP world): weights
moved in memory from the training shards, the same rollouts (per-sample seeds) and the same
loss and grad norm as one process within 1e-5 over 4 steps (two passes over each rollout),
the rollout's log-probs equal to the training forward's within 1e-5; TP2 in CI, PP2,
TP2 x PP2 (4 processes) and GRPO-LoRA at TP2 with ``-m slow``; the gathered weights (LoRA's
adapters included) are the training shards bit for bit."""

from __future__ import annotations

import pytest
from test_grpo import cli
from test_grpo_layouts import RUN, TOL

from anyspeed.testing import run_distributed
from helpers import sft_ranks

INFER = ["--infer-tensor-parallel-size", "1", "--infer-pipeline-parallel-size", "1",
         "--infer-expert-parallel-size", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def one(add_prompts, tiny_qwen, hf_tok) -> dict:
    argv = cli(tiny_qwen, add_prompts, hf_tok, *RUN, iters=4)
    return run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)[0]


def _check(got: dict, want: dict) -> None:
    m = got["metrics"]
    assert m["grpo/rewards/mean"] == want["metrics"]["grpo/rewards/mean"]
    assert m["response_length/mean"] == want["metrics"]["response_length/mean"]
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
    assert max(m["rollout/logp_mismatch_max"]) <= TOL
    # weights move before each rollout (steps 1 and 3: two steps per rollout)
    assert m["timing/reshard"][0] > 0 and m["timing/reshard"][2] > 0


def _run(world: int, argv: list[str]) -> dict:
    return run_distributed(sft_ranks.posttrain, world, argv=argv, cli=argv, timeout=600)[0]


def test_tp2_rolling_out_at_tp1_dp2(one, add_prompts, tiny_qwen, hf_tok):
    argv = cli(tiny_qwen, add_prompts, hf_tok, *RUN, "--tensor-model-parallel-size", "2",
               "--sequence-parallel", *INFER, iters=4)  # fmt: skip
    _check(_run(2, argv), one)


@pytest.mark.slow
@pytest.mark.parametrize("world,flags", [
    (2, ["--pipeline-model-parallel-size", "2"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
], ids=["pp2", "tp2-pp2"])  # fmt: skip
def test_model_parallel_rolling_out_at_tp1(one, add_prompts, tiny_qwen, hf_tok, world, flags):
    argv = cli(tiny_qwen, add_prompts, hf_tok, *RUN, *flags, *INFER, iters=4)
    _check(_run(world, argv), one)


@pytest.mark.parametrize("tp,pp,lora", [(2, 1, False), (1, 2, False), (2, 1, True)],
                         ids=["tp2", "pp2", "tp2-lora"])  # fmt: skip
def test_gathered_weights_are_the_training_shards_bit_for_bit(tp, pp, lora):
    from helpers import reshard_ranks

    ranks = run_distributed(reshard_ranks.gathered_weights, 2, tp=tp, pp=pp, lora=lora,
                            timeout=300)  # fmt: skip
    for r in ranks:
        assert r["differ"] == [] and r["compared"] > 0, r
        assert (r["adapters"] > 0) == lora, r
        assert r["logit_diff"] is None or r["logit_diff"] <= 1e-5, r
    # every rollout tensor came from some rank (the pipeline stages together hold them all)
    assert sum(r["compared"] for r in ranks) >= ranks[0]["rollout_tensors"]


@pytest.mark.slow
def test_lora_at_tp2_rolling_out_at_tp1(add_prompts, tiny_qwen, hf_tok):
    """GRPO-LoRA (adapters on qkv, the gated fc1 and fc2) at TP2+SP rolling out at TP1 x DP2
    against GRPO-LoRA in one process."""
    lora = ["--lora-r", "4", "--lora-target-modules", "linear_qkv", "linear_fc1", "linear_fc2"]
    argv = cli(tiny_qwen, add_prompts, hf_tok, *RUN, *lora, iters=4)
    want = _run(1, argv)
    _check(_run(2, argv + ["--tensor-model-parallel-size", "2", "--sequence-parallel", *INFER]),
           want)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
], ids=["tp2-sp", "ep2"])  # fmt: skip
def test_moe_rolling_out_at_tp1(add_prompts, hf_tok, tiny_moe, flags):
    """A Qwen3-MoE model (4 experts) with its experts split by TP, or over EP ranks, rolling
    out at TP1 x DP2 (every expert on every rank)."""
    from anyspeed.convert import hf_cache as hf_load

    argv = cli(tiny_moe, add_prompts, hf_tok, *RUN, "--init-kl-coef", "0", iters=4)
    want = _run(1, argv)
    two = argv + flags + INFER
    expanded = hf_load.expand(two, tiny_moe)  # the adaptor sees the MoE architecture flags
    got = run_distributed(sft_ranks.posttrain, 2, argv=expanded, cli=two, timeout=600)[0]
    _check(got, want)
