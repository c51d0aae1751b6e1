"""PPO under LoRA: the critic has adapters of its own and trains them with its value head, its
base frozen; its checkpoint (inside the policy's) holds only those; 2 saved + 2 resumed steps
(``--lora-load``) equal 4 straight for policy and critic; TP2+SP and PP2 equal one process."""

from __future__ import annotations

import os

import pytest
from test_ppo import cli

from anyspeed.testing import run_distributed
from helpers import sft_ranks

LORA = ["--lora-target-modules", "linear_qkv", "linear_proj", "--lora-r", "4",
        "--lora-alpha", "8", "--lr-decay-style", "constant", "--ppo-epochs", "2"]  # fmt: skip


def critic_keys(ck: str, iteration: int) -> set[str]:
    """The model keys of the critic saved inside the policy checkpoint of ``iteration``."""
    from megatron.core import dist_checkpointing

    from anyspeed.checkpoint.reads import tracked_dir

    critic = tracked_dir(os.path.join(ck, f"iter_{iteration:07d}", "critic"))
    meta = dist_checkpointing.load_tensors_metadata(critic)
    return {k for k in meta if not k.startswith(("optimizer.", "rng_state"))}


def test_lora_critic_trains_and_saves_adapters_and_head(add_prompts, tiny_qwen, hf_tok, tmp_path):
    """The fast twin: two LoRA PPO steps; the critic learns and its checkpoint holds only its
    adapters and head."""
    ck = str(tmp_path / "ck")
    argv = cli(tiny_qwen, add_prompts, hf_tok, *LORA, "--save", ck, iters=2)
    (h,) = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)
    assert max(h["metrics"]["critic/grad_norm"]) > 0
    keys = critic_keys(ck, 2)
    assert "output_layer.score.weight" in keys
    assert any(".lora_A" in k for k in keys) and any(".lora_B" in k for k in keys)
    assert all(".lora_" in k or k.startswith("output_layer.") for k in keys), sorted(keys)


@pytest.mark.slow  # the suite's time budget; the twin above runs LoRA PPO with a save (fast)
def test_resume_is_exact(add_prompts, tiny_qwen, hf_tok, tmp_path):
    """2 saved + 2 resumed (--lora-load) equal 4 straight, bit for bit, policy and critic."""
    ck = str(tmp_path / "ck")
    straight = cli(tiny_qwen, add_prompts, hf_tok, *LORA, iters=4)
    first = cli(tiny_qwen, add_prompts, hf_tok, *LORA, "--save", ck, "--save-interval", "2",
                iters=2)  # fmt: skip
    resumed = cli(tiny_qwen, add_prompts, hf_tok, *LORA, "--lora-load", ck, iters=4)
    whole, a, b = run_distributed(sft_ranks.posttrain_many, 1, argv=straight,
                                  clis=[straight, first, resumed], timeout=400)[0]  # fmt: skip
    assert a["loss"] + b["loss"] == whole["loss"]
    assert a["grad_norm"] + b["grad_norm"] == whole["grad_norm"]
    for k in ("critic/vf_loss", "critic/grad_norm", "grpo/rewards/mean"):
        assert a["metrics"][k] + b["metrics"][k] == whole["metrics"][k], k
    assert max(whole["metrics"]["critic/grad_norm"]) > 0
    assert any(".lora_A" in k for k in critic_keys(ck, 2))  # the critic resumed was a LoRA one


LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


@pytest.mark.slow
def test_layouts_equal_one_process(add_prompts, tiny_qwen, hf_tok):
    run = [*LORA, "--rollout-batch-size", "4"]
    one = cli(tiny_qwen, add_prompts, hf_tok, *run, iters=4)
    want = run_distributed(sft_ranks.posttrain, 1, argv=one, cli=one, timeout=300)[0]
    argvs = [cli(tiny_qwen, add_prompts, hf_tok, *run, *f, iters=4) for f in LAYOUTS.values()]
    out = run_distributed(sft_ranks.posttrain_many, 2, argv=argvs[0], clis=argvs, timeout=600)
    for i, name in enumerate(LAYOUTS):
        got = out[0][i]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7), name
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), name
        for k in ("critic/vf_loss", "critic/grad_norm", "critic/vf_explained_var"):
            got_k, want_k = got["metrics"][k], want["metrics"][k]
            assert got_k == pytest.approx(want_k, rel=1e-5, abs=1e-7), (name, k)
