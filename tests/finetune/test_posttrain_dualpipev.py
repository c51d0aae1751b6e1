"""The post-training stages that train under DualPipeV, against one process of the same HF
model, each at PP2 with deferred weight gradients and tied embeddings (fp32, within 1e-5):

* DPO (its frozen reference's log-probs in a forward-only pass through the V), SimPO, the
  outcome reward model (a scalar head on rank 0's second chunk) and the process reward model:
  three steps' losses, grad norms and every logged metric;
* GRPO (rollouts decoded through the V with the KV cache), PPO (a critic at the same V) and
  on-policy distillation (a teacher of another width split by the same V): the same rewards,
  losses and grad norms over two passes per rollout."""

from __future__ import annotations

import pytest
from test_distill import cli as distill_cli
from test_distill import teacher  # noqa: F401 - the fixture
from test_dpo import cli
from test_grpo import cli as grpo_cli
from test_ppo import cli as ppo_cli
from test_prm import cli as prm_cli

from anyspeed.testing import run_distributed
from helpers import sft_ranks

TOL = 1e-5
V = ["--pipeline-model-parallel-size", "2", "--schedules-method", "dualpipev",
     "--dualpipev-dw-detach"]  # fmt: skip


def _argv(stage: str, pair_data: str, step_data: str, hf: str, tok: str) -> list[str]:
    if stage == "prm":  # 4 micro-batches of 2: two per V stage
        return prm_cli(hf, step_data, tok, "--micro-batch-size", "2", iters=3, gbs=8)
    return cli(hf, pair_data, stage=stage, iters=3)


@pytest.mark.parametrize(
    "stage", ["dpo", *(pytest.param(s, marks=pytest.mark.slow) for s in ("simpo", "orm", "prm"))]
)
def test_stage_equals_one_process(stage, pair_data, step_data, tied_qwen4, hf_tok):
    one = _argv(stage, pair_data, step_data, tied_qwen4, hf_tok)
    ref = run_distributed(sft_ranks.posttrain, 1, argv=one, cli=one, timeout=300)[0]
    two = run_distributed(sft_ranks.posttrain, 2, argv=one + V, cli=one + V, timeout=300)[0]
    assert two["loss"] == pytest.approx(ref["loss"], rel=TOL)
    assert two["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL)
    assert ref["metrics"] and set(two["metrics"]) == set(ref["metrics"])
    for key, want in ref["metrics"].items():
        assert two["metrics"][key] == pytest.approx(want, rel=TOL, abs=1e-6), key
    assert ref["loss"][-1] < ref["loss"][0]


def _rl_argv(stage: str, prompts: str, hf: str, tok: str, teacher_dir: str) -> list[str]:
    mu = ["--ppo-epochs", "2", "--lr-decay-style", "constant", "--micro-batch-size", "2"]
    if stage.startswith("grpo"):
        rewards = ["--verifier-function", "helpers.user_rewards:vowels"]
        argv = grpo_cli(hf, prompts, tok, *mu, *rewards, "--rollout-batch-size", "4", iters=2)
        return argv if stage == "grpo" else [*argv, *INFER_WHOLE]
    if stage == "ppo":
        return ppo_cli(hf, prompts, tok, "--micro-batch-size", "2", iters=3)
    return distill_cli(hf, prompts, tok, teacher_dir, *mu, "--lr", "1e-2", iters=4)


# grpo-reshard: rollouts at TP1 x PP1 x DP2, their weights gathered from the V (the single
# process ignores the flags' layout)
INFER_WHOLE = ["--infer-tensor-parallel-size", "1", "--infer-pipeline-parallel-size", "1",
               "--infer-expert-parallel-size", "1"]  # fmt: skip
SLOW_RL = ("grpo-reshard", "ppo", "distill")


@pytest.mark.parametrize(
    "stage", ["grpo", *(pytest.param(s, marks=pytest.mark.slow) for s in SLOW_RL)]
)
def test_rl_stage_equals_one_process(stage, add_prompts, tied_qwen4, hf_tok, teacher):  # noqa: F811
    one = _rl_argv(stage, add_prompts, tied_qwen4, hf_tok, teacher)
    ref = run_distributed(sft_ranks.posttrain, 1, argv=one, cli=one, timeout=300)[0]
    two = run_distributed(sft_ranks.posttrain, 2, argv=one + V, cli=one + V, timeout=300)[0]
    assert two["loss"] == pytest.approx(ref["loss"], rel=TOL, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL)
    for key, want in ref["metrics"].items():
        if "reward" in key or "kl" in key or "logp_mismatch" in key:
            assert two["metrics"][key] == pytest.approx(want, rel=TOL, abs=1e-6), key
