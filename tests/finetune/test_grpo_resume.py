"""GRPO checkpoints: 4 steps straight equal 2 saved + 2 resumed (policy, optimizer, data
position and the rollouts' seeds), under LoRA the reference is the base with adapters off,
and ``--rl-config`` stands in for flags (flags given win)."""

from __future__ import annotations

import pytest
from test_grpo import cli

from anyspeed.testing import run_distributed
from helpers import sft_ranks

RUN = ["--verifier-function", "helpers.user_rewards:vowels", "--lr-decay-style", "constant",
       "--ppo-epochs", "2"]  # fmt: skip


def resume_clis(hf: str, prefix: str, tok: str, run: list[str], ck: str) -> list[list[str]]:
    """4 steps straight, 2 saved at ``ck``, and 2 more resumed from ``ck``."""
    from anyspeed.convert import hf_cache as hf_load

    straight = cli(hf, prefix, tok, *run, iters=4)
    first = cli(hf, prefix, tok, *run, "--save", ck, "--save-interval", "2", iters=2)
    resumed = hf_load.expand(cli(ck, prefix, tok, *run, iters=4), hf)
    resumed.remove("--finetune")
    return [straight, first, resumed]


def test_resume_is_exact(add_prompts, tiny_qwen, hf_tok, tmp_path):
    straight, first, resumed = resume_clis(tiny_qwen, add_prompts, hf_tok, RUN,
                                           str(tmp_path / "ck"))  # fmt: skip
    whole, a, b = run_distributed(sft_ranks.posttrain_many, 1, argv=straight,
                                  clis=[straight, first, resumed], timeout=300)[0]  # fmt: skip
    assert a["loss"] + b["loss"] == whole["loss"]
    assert a["grad_norm"] + b["grad_norm"] == whole["grad_norm"]
    r = "grpo/rewards/mean"
    assert a["metrics"][r] + b["metrics"][r] == whole["metrics"][r]


def test_lora_and_rl_config(add_prompts, tiny_qwen, hf_tok, tmp_path):
    """GRPO-LoRA at lr 0: the reference (base, adapters off) equals the policy, KL 0 and
    ratio 1; a YAML's keys set the clip and the temperature (a flag given wins)."""
    cfg = tmp_path / "rl.yaml"
    cfg.write_text("rl_config:\n  n_samples_per_prompt: 2\n  clip_ratio: 0.1\n"
                   "  clip_ratio_high: 0.3\n  init_kl_coef: 0.5\ngenerate_config:\n"
                   "  sampling_config:\n    temperature: 0.7\n")  # fmt: skip
    argv = cli(tiny_qwen, add_prompts, hf_tok, "--rl-config", str(cfg), "--init-kl-coef",
               "0.2", "--lora-target-modules", "linear_qkv", "--lora-r", "4", "--lr", "0",
               "--verifier-function", "helpers.user_rewards:vowels")  # fmt: skip
    from anyspeed.stages.prepare import prepare

    run, _ = prepare(argv, "launcher", "posttrain")
    c = run.config
    # the command line's --n-samples-per-prompt 4 and --init-kl-coef 0.2 win over the file's
    assert (c.group, c.clip_low, c.clip_high, c.beta, c.temperature) == (4, 0.1, 0.3, 0.2, 0.7)
    hist = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)[0]
    m = hist["metrics"]
    assert m["actor/ppo_kl"] == [0.0, 0.0] and max(m["actor/kl_loss"]) < 1e-9
    assert hist["grad_norm"][0] > 0  # the adapters' gradient (B starts at zero, A does not)


def test_lora_rollouts_use_the_adapters(add_prompts, tiny_qwen, hf_tok):
    """Once the adapters have moved, the rollout (KV-cache decoding) still samples with them:
    its log-probs are the training forward's (a decode path that skipped the adapters' hooks
    was off by 0.2)."""
    argv = cli(tiny_qwen, add_prompts, hf_tok, "--lora-target-modules", "linear_qkv",
               "linear_proj", "linear_fc1", "linear_fc2", "--lora-r", "4", "--lr", "1e-2",
               "--verifier-function", "helpers.user_rewards:vowels", iters=3)  # fmt: skip
    hist = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)[0]
    assert max(hist["metrics"]["rollout/logp_mismatch_max"]) <= 1e-5


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--global-batch-size", "10"], "not a multiple of --n-samples-per-prompt 4"),
        (["--max-prompt-length", "80", "--max-response-length", "30"], "exceed --seq-length 96"),
        (["--verifier-function", "nope"], "--verifier-function"),
        (["--save", "X", "--save-interval", "1", "--ppo-epochs", "2"], "--save-interval 1"),
        (["--context-parallel-size", "2"], "--context-parallel-size > 1 is not supported"),
        (
            [
                "--tensor-model-parallel-size",
                "2",
                "--infer-tensor-parallel-size",
                "2",
                "--infer-pipeline-parallel-size",
                "2",
            ],
            "must be 1, 1, 1",
        ),
        (
            [
                "--tensor-model-parallel-size",
                "2",
                "--infer-tensor-parallel-size",
                "1",
                "--num-experts",
                "4",
                "--moe-grouped-gemm",
            ],
            "with --moe-grouped-gemm is not supported",
        ),  # fmt: skip
    ],
)
def test_bad_flags_are_one_line(capsys, add_prompts, tiny_qwen, hf_tok, extra, message):
    from test_posttrain_errors import _error

    err = _error(capsys, cli(tiny_qwen, add_prompts, hf_tok, *extra))
    assert message in err


def test_sft_data_is_refused(capsys, sft_data, tiny_qwen, hf_tok):
    from test_posttrain_errors import _error

    err = _error(capsys, cli(tiny_qwen, sft_data["padded"], hf_tok))
    assert "is SFT data" in err
