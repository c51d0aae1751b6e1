"""``--fp8-format`` in post-training: GRPO's training passes (old-policy, reference and update
log-probs) and LoRA SFT on frozen FP8 base weights run FP8 GEMMs: each run stays near the same
run without FP8 and is not it. GRPO's rollouts decode in the run's precision, so the
rollout-vs-training log-prob mismatch it reports is FP8's own."""

from __future__ import annotations

import pytest
from test_grpo import cli
from test_lora import lora_cli

from anyspeed.testing import run_distributed
from helpers import sft_ranks

FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]


def _near_but_not_equal(fp8: dict, plain: dict, rel: float) -> None:
    assert fp8["loss"] == pytest.approx(plain["loss"], rel=rel)
    assert fp8["loss"] != plain["loss"]


def test_grpo_in_fp8(add_prompts, tiny_qwen, hf_tok):
    run = ["--verifier-function", "helpers.user_rewards:vowels", "--ppo-epochs", "2",
           "--optimization-level", "1"]  # fmt: skip
    argvs = [cli(tiny_qwen, add_prompts, hf_tok, *run, *x, iters=2) for x in (FP8, [])]
    fp8, plain = run_distributed(sft_ranks.posttrain_many, 1, argv=argvs[0], clis=argvs,
                                 timeout=300)[0]  # fmt: skip
    # the first rollout is the same (same weights, decoded without FP8)
    assert fp8["metrics"]["grpo/rewards/mean"][0] == plain["metrics"]["grpo/rewards/mean"][0]
    _near_but_not_equal(fp8, plain, 0.05)
    mismatch = fp8["metrics"]["rollout/logp_mismatch_max"]
    assert max(plain["metrics"]["rollout/logp_mismatch_max"]) <= 1e-5 < max(mismatch) < 0.5


def test_lora_sft_in_fp8(sft_data, tiny_qwen):
    argvs = [lora_cli(tiny_qwen, sft_data["padded"], *x) for x in (FP8, [])]
    fp8, plain = run_distributed(sft_ranks.posttrain_many, 1, argv=argvs[0], clis=argvs,
                                 timeout=300)[0]  # fmt: skip
    _near_but_not_equal(fp8, plain, 0.01)
