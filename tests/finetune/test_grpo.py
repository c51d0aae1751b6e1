"""GRPO end to end on a converted tiny Qwen2 (1 process): the degenerate cases (learning rate 0:
ratio exactly 1, no clipping; reference = policy: KL 0; equal rewards: zero gradient), the
rollout's own log-probs against the training forward's, a learnable reward rising in 10 steps
and two runs identical (``-m slow``), and a failing reward function stopping the run with
one line."""

from __future__ import annotations

import json
import os

import pytest

from anyspeed.testing import run_distributed
from helpers import sft_ranks


def cli(hf: str, prefix: str, tok: str, *extra: str, iters: int = 2) -> list[str]:
    return ["--stage", "grpo", "--load", hf, "--finetune", "--data-path", prefix,
            "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tok,
            "--seq-length", "96", "--max-response-length", "16", "--n-samples-per-prompt", "4",
            "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", str(iters),
            "--lr", "1e-3", "--split", "100,0,0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
            "--no-progress-bar", "--seed", "5", *extra]  # fmt: skip


def one_and_layouts(one: list[str], argvs: list[list[str]]) -> tuple[dict, list[dict]]:
    """The history of ``one`` in one process, and of each of ``argvs`` in two."""
    ref = run_distributed(sft_ranks.posttrain, 1, argv=one, cli=one, timeout=300)[0]
    out = run_distributed(sft_ranks.posttrain_many, 2, argv=argvs[0], clis=argvs, timeout=600)
    return ref, out[0]


def test_degenerate_cases_and_zero_mismatch(add_prompts, tiny_qwen, hf_tok):
    """lr 0, mu = 2 (two passes over each rollout): the ratio stays exactly 1 (ppo_kl 0, no
    clip); the reference is the policy: KL 0; the rollout's log-probs are the training
    forward's within 1e-5. Equal rewards (no KL term): zero gradient."""
    lr0 = cli(tiny_qwen, add_prompts, hf_tok, "--lr", "0", "--ppo-epochs", "2",
              "--verifier-function", "helpers.user_rewards:digits", iters=4)  # fmt: skip
    flat = cli(tiny_qwen, add_prompts, hf_tok, "--verifier-function",
               "helpers.user_rewards:constant", "--init-kl-coef", "0")  # fmt: skip
    # GSPO on policy (lr 0: every ratio 1) has GRPO's seq-mean-token-mean gradient
    seq = ["--lr", "0", "--init-kl-coef", "0", "--loss-agg-mode", "seq-mean-token-mean",
           "--verifier-function", "helpers.user_rewards:digits"]  # fmt: skip
    grpo = cli(tiny_qwen, add_prompts, hf_tok, *seq)
    gspo = cli(tiny_qwen, add_prompts, hf_tok, *seq, "--importance-sampling-level", "sequence")
    # rollout correction in fp32 at the training layout: weights 1 to ~1e-7, nothing rejected
    corr = cli(tiny_qwen, add_prompts, hf_tok, *seq, "--rollout-is", "token",
               "--rollout-rs", "geometric", "--rollout-rs-threshold", "1.001")  # fmt: skip
    runs = run_distributed(sft_ranks.posttrain_many, 1, argv=lr0,
                           clis=[lr0, flat, grpo, gspo, corr], timeout=300)[0]  # fmt: skip
    assert runs[4]["grad_norm"] == pytest.approx(runs[2]["grad_norm"], rel=1e-5)
    c = runs[4]["metrics"]
    assert c["rollout_corr/rollout_rs_masked_fraction"] == [0.0, 0.0]
    assert max(abs(x) for x in c["rollout_corr/kl"] + c["rollout_corr/chi2_token"]) < 1e-5
    assert c["rollout_corr/rollout_is_mean"] == pytest.approx([1.0, 1.0], abs=1e-5)
    assert max(runs[2]["grad_norm"]) > 0
    assert runs[3]["grad_norm"] == pytest.approx(runs[2]["grad_norm"], rel=1e-5)
    assert runs[3]["metrics"]["actor/pg_clipfrac"] == [0.0, 0.0]
    m = runs[0]["metrics"]
    assert m["actor/ppo_kl"] == [0.0] * 4 and m["actor/pg_clipfrac"] == [0.0] * 4
    assert max(m["actor/kl_loss"]) < 1e-9
    assert max(m["rollout/logp_mismatch_max"]) <= 1e-5
    assert runs[1]["grad_norm"] == [0.0, 0.0]
    assert runs[1]["metrics"]["grpo/zero_adv_groups"] == [1.0, 1.0]


@pytest.mark.slow  # 35 s of learning (CI time); fast GRPO paths: the tests around it
def test_reward_rises_and_runs_repeat(add_prompts, tiny_qwen, hf_tok):
    """A learnable reward (the share of vowels) rises over 10 steps of 64 samples; a second
    run with the same seed gives the same losses, rewards and grad norms."""
    argv = cli(tiny_qwen, add_prompts, hf_tok, "--verifier-function",
               "helpers.user_rewards:vowels", "--init-kl-coef", "0", "--lr", "1e-2",
               "--lr-decay-style", "constant", "--n-samples-per-prompt", "8",
               "--global-batch-size", "64", "--micro-batch-size", "16", iters=10)  # fmt: skip
    a, b = run_distributed(sft_ranks.posttrain_many, 1, argv=argv, clis=[argv, argv],
                           timeout=300)[0]  # fmt: skip
    r = a["metrics"]["grpo/rewards/mean"]
    assert sum(r[-3:]) / 3 > sum(r[:3]) / 3 + 0.1, r
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert a["metrics"]["grpo/rewards/mean"] == b["metrics"]["grpo/rewards/mean"]


def test_failing_reward_stops_with_one_line(add_prompts, tiny_qwen, hf_tok, tmp_path):
    from anyspeed.commands.train import posttrain
    from helpers.inprocess import clean_after

    ck = str(tmp_path / "ck")
    argv = cli(tiny_qwen, add_prompts, hf_tok, "--verifier-function",
               "helpers.user_rewards:always_fails", "--save", ck)  # fmt: skip
    os.environ.pop("WORLD_SIZE", None)
    with clean_after():
        rc = posttrain(argv)
    assert rc == 1
    assert not os.path.exists(os.path.join(ck, "latest_checkpointed_iteration.txt"))
    json.dumps(rc)


def test_gspo_refuses_a_token_mean(capsys, add_prompts, tiny_qwen, hf_tok):
    """One sequence ratio weighs each sequence once: GSPO under a token mean is refused before
    start, naming both flags and the two ways out."""
    from anyspeed.commands.train import posttrain

    os.environ.pop("WORLD_SIZE", None)
    argv = cli(tiny_qwen, add_prompts, hf_tok, "--importance-sampling-level", "sequence")
    assert posttrain(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--importance-sampling-level sequence" in err
    assert "--loss-agg-mode token-mean" in err and "sequence_token" in err


def test_a_group_of_one_is_refused(capsys, add_prompts, tiny_qwen, hf_tok):
    """A group of one has no group-normalised advantage (PPO's critic has one: --stage ppo)."""
    from anyspeed.commands.train import posttrain

    os.environ.pop("WORLD_SIZE", None)
    argv = cli(tiny_qwen, add_prompts, hf_tok, "--n-samples-per-prompt", "1",
               "--global-batch-size", "4")  # fmt: skip
    assert posttrain(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a group of one" in err and "--stage ppo" in err
