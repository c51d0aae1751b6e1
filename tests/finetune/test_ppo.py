"""PPO end to end on a converted tiny Qwen2 (1 process): the degenerate case (policy learning
rate 0: ratio exactly 1, no clip) with the critic learning, its metrics and the explained
variance; the critic saved inside the policy's checkpoint and 4 steps straight equal to 2
saved + 2 resumed (policy and critic); a critic warm-up; bad flags refused in one line."""

from __future__ import annotations

import os

import pytest

from anyspeed.testing import run_distributed
from helpers import sft_ranks


def cli(hf: str, prefix: str, tok: str, *extra: str, iters: int = 2) -> list[str]:
    return ["--stage", "ppo", "--load", hf, "--finetune", "--data-path", prefix,
            "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tok,
            "--seq-length", "96", "--max-response-length", "16", "--n-samples-per-prompt", "2",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(iters),
            "--lr", "1e-3", "--critic-lr", "1e-3", "--split", "100,0,0",
            "--init-kl-coef", "0", "--verifier-function", "helpers.user_rewards:digits",
            "--eval-iters", "0", "--log-interval", "1", "--no-progress-bar", "--seed", "5",
            *extra]  # fmt: skip


@pytest.mark.slow  # the suite's time budget; the resume test runs PPO with a save (fast)
def test_policy_at_rest_and_critic_learning(add_prompts, tiny_qwen, hf_tok, tmp_path):
    """Policy lr 0 with two passes per rollout: its ratio stays exactly 1 (ppo_kl 0, no clip)
    while the critic trains: its value loss falls over the passes of each rollout; the critic
    is saved inside the policy checkpoint."""
    save = str(tmp_path / "ck")
    argv = cli(tiny_qwen, add_prompts, hf_tok, "--lr", "0", "--ppo-epochs", "2", "--save", save,
               iters=4)  # fmt: skip
    (hist,) = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)
    m = hist["metrics"]
    assert m["actor/ppo_kl"] == [0.0] * 4 and m["actor/pg_clipfrac"] == [0.0] * 4
    for k in ("critic/vf_loss", "critic/vpred_mean", "critic/vf_explained_var"):
        assert all(abs(x) < 1e6 for x in m[k]), (k, m[k])
    assert max(m["critic/grad_norm"]) > 0
    assert os.path.isfile(os.path.join(save, "iter_0000004", "critic",
                                       "latest_checkpointed_iteration.txt"))  # fmt: skip


RUN = ["--lr-decay-style", "constant", "--ppo-epochs", "2"]


def test_resume_is_exact(add_prompts, tiny_qwen, hf_tok, tmp_path):
    """The critic is resumed from the policy's checkpoint with its optimizer and schedule:
    losses, grad norms and critic losses of 2 + 2 steps equal 4 straight, bit for bit."""
    from anyspeed.convert import hf_cache

    ck = str(tmp_path / "ck")
    straight = cli(tiny_qwen, add_prompts, hf_tok, *RUN, iters=4)
    first = cli(tiny_qwen, add_prompts, hf_tok, *RUN, "--save", ck, "--save-interval", "2",
                iters=2)  # fmt: skip
    resumed = hf_cache.expand(cli(ck, add_prompts, hf_tok, *RUN, iters=4), tiny_qwen)
    resumed.remove("--finetune")
    whole, a, b = run_distributed(sft_ranks.posttrain_many, 1, argv=straight,
                                  clis=[straight, first, resumed], timeout=400)[0]  # fmt: skip
    assert a["loss"] + b["loss"] == whole["loss"]
    assert a["grad_norm"] + b["grad_norm"] == whole["grad_norm"]
    for k in ("critic/vf_loss", "critic/grad_norm", "grpo/rewards/mean"):
        assert a["metrics"][k] + b["metrics"][k] == whole["metrics"][k], k
    critic = os.path.join(ck, "iter_0000002", "critic", "latest_checkpointed_iteration.txt")
    assert os.path.isfile(critic)  # inside the policy's checkpoint
    assert max(whole["metrics"]["critic/grad_norm"]) > 0


def test_critic_warmup(add_prompts, tiny_qwen, hf_tok):
    """Two critic-only rollouts, then the policy's: with the policy at rest (lr 0) the warm run's
    first rollout is a plain run's third, critic included: the same metrics bit for bit."""
    still = [*RUN, "--lr", "0"]
    warm = cli(tiny_qwen, add_prompts, hf_tok, *still, "--critic-warmup", "2", iters=2)
    plain = cli(tiny_qwen, add_prompts, hf_tok, *still, iters=6)
    w, p = run_distributed(sft_ranks.posttrain_many, 1, argv=warm, clis=[warm, plain],
                           timeout=400)[0]  # fmt: skip
    for k in ("critic/vf_loss", "critic/grad_norm", "critic/vf_explained_var",
              "grpo/rewards/mean"):  # fmt: skip
        assert w["metrics"][k] == p["metrics"][k][4:], k
    assert w["grad_norm"] == p["grad_norm"][4:]


@pytest.mark.parametrize(("extra", "line"), [
    (["--adv-estimator", "group_norm"], "PPO's advantages are its critic's (gae)"),
    (["--clip-ratio-c", "0.5"], "--clip-ratio-c 0.5 must be above 1"),
    (["--gamma", "1.5"], "--gamma must be <= 1"),
    (["--critic-load", "/no/such/critic"],
     "--critic-load '/no/such/critic' is not a checkpoint directory"),
])  # fmt: skip
def test_bad_flags_are_one_line(capsys, add_prompts, tiny_qwen, hf_tok, extra, line):
    from anyspeed.commands.train import posttrain

    os.environ.pop("WORLD_SIZE", None)
    assert posttrain(cli(tiny_qwen, add_prompts, hf_tok, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and line in err, err


@pytest.mark.parametrize("layout", [
    [], pytest.param(["--pipeline-model-parallel-size", "2"], marks=pytest.mark.slow),
], ids=["one", "pp2"])  # fmt: skip
def test_memory_estimate_of_the_critic(add_prompts, tiny_qwen, hf_tok, layout):
    """``anyspeed memory --critic``'s bytes for the critic equal what the run's critic holds
    (parameters, gradients, optimizer state, counted from its tensors) on every rank."""
    argv = cli(tiny_qwen, add_prompts, hf_tok, *layout)
    ranks = run_distributed(sft_ranks.critic_held, 2 if layout else 1, argv=argv, cli=argv,
                            timeout=300)  # fmt: skip
    for r in ranks:
        held = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        assert r["estimate"] == pytest.approx(held, rel=0.01), r


def test_default_split_and_eval_iters_are_accepted(add_prompts, tiny_qwen, hf_tok):
    """RL stages evaluate nothing: ``--eval-iters`` defaults to 0, so the default ``--split``
    (969,30,1), whose test share of 48 prompts gets none, is accepted before start."""
    from anyspeed.stages.prepare import prepare

    argv = cli(tiny_qwen, add_prompts, hf_tok)
    for flag in ("--split", "--eval-iters", "--critic-lr"):  # the last: GRPO has no critic
        i = argv.index(flag)
        del argv[i : i + 2]
    for stage in ("ppo", "grpo"):
        argv[argv.index("--stage") + 1] = stage
        run, _ = prepare(argv, "launcher", "posttrain")
        assert run.args.eval_iters == 0 and run.args.split == "969,30,1"
