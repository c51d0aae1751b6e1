"""``anyspeed verify`` on ``anyspeed posttrain`` command lines: SFT with LoRA at TP2 (fast),
and (slow) full SFT at PP2 and CP2, DPO, DPO-LoRA, ORM, GRPO and distillation at other
layouts, the process reward model and GRPO on its step scores, each against one process from
the same weights and batches."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_distill import cli as distill_cli
from test_distill import teacher  # noqa: F401 - the teacher fixture
from test_dpo import cli as dpo_cli
from test_grpo import cli as grpo_cli
from test_prm import cli as prm_cli
from test_sft_loss import cli as sft_cli

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA = ["--lora-r", "4", "--lora-alpha", "8", "--lora-target-modules", "linear_qkv",
        "linear_fc2"]  # fmt: skip
TP2 = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"]
DP2 = ["--nproc-per-node", "2", "--use-distributed-optimizer"]


def verify(*argv: str) -> str:
    """``anyspeed verify`` (3 steps), asserted to pass; its last line."""
    env = {**os.environ, "PYTHONPATH": TESTS}  # the user reward module of the GRPO rows
    out = subprocess.run([sys.executable, "-m", "anyspeed", "verify", "posttrain", *argv],
                         capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    last = out.stdout.splitlines()[-1]
    assert last.startswith("PASS: 3 steps"), last
    return last


def test_sft_lora_at_tp2(sft_data, tiny_qwen):
    verify(*sft_cli(tiny_qwen, sft_data["padded"], *LORA, "--lr", "1e-2"), *TP2,
           "--sequence-parallel")  # fmt: skip


def _rows(
    sft_data,
    pair_data,
    add_prompts,
    tiny_qwen,
    hf_tok,
    teacher,  # noqa: F811 - a fixture's value
    step_data,
) -> dict[str, list[str]]:
    grpo = grpo_cli(tiny_qwen, add_prompts, hf_tok, "--verifier-function",
                    "helpers.user_rewards:vowels", "--ppo-epochs", "2", "--rollout-batch-size",
                    "4")  # fmt: skip
    return {
        "sft-pp2": [
            *sft_cli(tiny_qwen, sft_data["padded"]),
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
        ],  # fmt: skip
        "sft-cp2": [
            *sft_cli(tiny_qwen, sft_data["padded"]),
            "--nproc-per-node",
            "2",
            "--context-parallel-size",
            "2",
        ],  # fmt: skip
        "dpo-tp2-sp": [*dpo_cli(tiny_qwen, pair_data), *TP2, "--sequence-parallel"],
        "dpo-lora-dp2": [*dpo_cli(tiny_qwen, pair_data, *LORA), *DP2],
        # lr 1e-4: at 1e-3 Adam makes the grad norm drift 1.8e-5 by step 2 (step 1: 3e-8)
        "orm-tp2": [*dpo_cli(tiny_qwen, pair_data, "--lr", "1e-4", stage="orm"), *TP2],
        "grpo-dp2": [*grpo, *DP2],
        # remove-padding by a token budget: PP2's packed sequences of one length
        "grpo-packed-pp2": [
            *grpo,
            "--optimization-level",
            "1",
            "--use-remove-padding",
            "--use-dynamic-bsz",
            "--max-packing-token-size",
            "120",
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
        ],  # fmt: skip
        "grpo-lora-tp2-sp": [*grpo, *LORA, *TP2, "--sequence-parallel"],
        # lr 1e-4: at 1e-2 Adam makes a gradient tensor drift 1.6e-4 of its norm by step 2
        "distill-tp2-sp": [
            *distill_cli(
                tiny_qwen, add_prompts, hf_tok, teacher, "--lr", "1e-4", "--ppo-epochs", "2"
            ),
            *TP2,
            "--sequence-parallel",
        ],
        "prm-tp2-sp": [*prm_cli(tiny_qwen, step_data, hf_tok), *TP2, "--sequence-parallel"],
        "grpo-prm-pp2": [
            *grpo_cli(
                tiny_qwen,
                add_prompts,
                hf_tok,
                "--process-reward-model",
                tiny_qwen,
                "--prm-placeholder-token",
                "@",
                "--prm-reward-tokens",
                "+",
                "-",
                "--seq-length",
                "128",
                "--lr",
                "1e-4",
            ),
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
        ],  # fmt: skip
    }


ROWS = ["sft-pp2", "sft-cp2", "dpo-tp2-sp", "dpo-lora-dp2", "orm-tp2", "grpo-dp2",
        "grpo-packed-pp2", "grpo-lora-tp2-sp", "distill-tp2-sp", "prm-tp2-sp",
        "grpo-prm-pp2"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS)
def test_posttrain_layouts_pass(row, sft_data, pair_data, add_prompts, tiny_qwen, hf_tok,
                               teacher, step_data):  # noqa: F811 - the fixture  # fmt: skip
    rows = _rows(sft_data, pair_data, add_prompts, tiny_qwen, hf_tok, teacher, step_data)
    verify(*rows[row])
