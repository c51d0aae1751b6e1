"""Checkpoints written by an earlier anyspeed load, resume and convert with this one: pretrain,
SFT-LoRA, DPO, GRPO and a LLaVA (vlm) checkpoint are written by the checkout whose ``src`` is
``ANYSPEED_PREVIOUS_SRC`` (e.g. a ``git worktree`` of the previous main), then resumed,
converted to Hugging Face and (LLaVA) generated from by this code. Skipped without it; slow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_dpo import cli as dpo_cli
from test_grpo import cli as grpo_cli
from test_sft_loss import cli as sft_cli

from anyspeed.demo import mm_data

OLD = os.environ.get("ANYSPEED_PREVIOUS_SRC", "")
TESTS = str(Path(__file__).resolve().parents[1])
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not OLD, reason="set ANYSPEED_PREVIOUS_SRC to an earlier checkout's src"),
]


def _run(argv: list[str], old: bool) -> str:
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    env["PYTHONPATH"] = (OLD + ":" if old else "") + TESTS
    r = subprocess.run([sys.executable, "-m", "anyspeed", *argv], env=env, capture_output=True,
                       text=True, timeout=900)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-2000:]
    return out


def _iters(argv: list[str], n: int) -> list[str]:
    a = list(argv)
    a[a.index("--train-iters") + 1] = str(n)
    return a


def _resume(argv: list[str], save: str, n: int) -> list[str]:
    from anyspeed.convert.hf_cache import expand

    a = _iters(argv, n)
    hf = a[a.index("--load") + 1]
    a = [a[0], *expand(a[1:], hf)]
    a[a.index("--load") + 1] = save
    a.remove("--finetune")
    return a


def test_old_checkpoints(sft_data, pair_data, tiny_qwen, add_prompts, hf_tok, tmp_path):
    d = tmp_path
    # pretrain
    pre = ["pretrain", "--model", "tiny-qwen2.5", "--mock-data", "--vocab-size", "512",
           "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--train-iters", "2", "--save", str(d / "pre"), "--save-interval", "2",
           "--eval-iters", "0", "--no-progress-bar", "--lr", "1e-3"]  # fmt: skip
    _run(pre, old=True)
    out = _run(_iters(pre, 3) + ["--load", str(d / "pre")], old=False)
    assert "at iteration 2" in out
    _run(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
          str(d / "pre"), "--save-dir", str(d / "pre-hf")], old=False)  # fmt: skip
    # SFT-LoRA
    lora = ["--lora-target-modules", "linear_qkv", "--lora-r", "4"]
    sft = ["posttrain", *_iters(sft_cli(tiny_qwen, sft_data["padded"], *lora, "--save",
                                        str(d / "sft"), "--save-interval", "2"), 2)]  # fmt: skip
    _run(sft, old=True)
    resumed = _iters(sft, 3) + ["--lora-load", str(d / "sft")]
    resumed[resumed.index("--save") + 1] = str(d / "sft2")
    out = _run(resumed, old=False)
    (base,) = [str(x) for x in (d / "sft2").glob("from-hf-*")]
    _run(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
          base, "--save-dir", str(d / "sft-hf"), "--lora-load", str(d / "sft"),
          "--lora-target-modules", "linear_qkv", "--lora-r", "4"], old=False)  # fmt: skip
    # DPO
    dpo = ["posttrain", *dpo_cli(tiny_qwen, pair_data, "--save", str(d / "dpo"),
                                 "--save-interval", "2")]  # fmt: skip
    _run(dpo, old=True)
    out = _run(_resume(dpo, str(d / "dpo"), 3), old=False)
    assert "at iteration 2" in out
    _run(["convert", "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
          str(d / "dpo"), "--save-dir", str(d / "dpo-hf")], old=False)  # fmt: skip
    # GRPO
    grpo = ["posttrain", *grpo_cli(tiny_qwen, add_prompts, hf_tok, "--verifier-function",
                                   "helpers.user_rewards:vowels", "--save", str(d / "grpo"),
                                   "--save-interval", "2")]  # fmt: skip
    _run(grpo, old=True)
    out = _run(_resume(grpo, str(d / "grpo"), 3), old=False)
    assert "at iteration 2" in out
    # LLaVA: trained (vlm) by the old code, resumed, converted and generated from by this one
    data = mm_data.make_records(str(d / "mm"), 16, 2, "train")
    hf = mm_data.make_model(str(d / "mm" / "hf"))
    vlm = ["posttrain", "--stage", "vlm", "--load", hf, "--data-path", data, "--seq-length",
           "48", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
           "--lr", "1e-3", "--split", "100,0,0", "--log-interval", "1",
           "--make-vocab-size-divisible-by", "1", "--save", str(d / "vlm"),
           "--save-interval", "2"]  # fmt: skip
    _run(vlm, old=True)
    res = _iters(vlm, 3)
    res[res.index("--load") + 1] = str(d / "vlm")
    res += ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", hf]
    out = _run(res, old=False)
    _run(
        [
            "convert",
            "--load-model-type",
            "mg",
            "--save-model-type",
            "hf",
            "--load-dir",
            str(d / "vlm"),
            "--save-dir",
            str(d / "vlm-hf"),
            "--hf-cfg-dir",
            hf,
        ],
        old=False,
    )
    img = str(d / "mm" / "images" / "train_00000.png")
    out = _run(["generate", "--load", str(d / "vlm"), "--image", img, "--max-new-tokens", "4",
                "--tokenizer-name-or-path", hf], old=False)  # fmt: skip
    assert "image: " in out
