"""The process reward model (``--stage prm``): its first step's loss and step accuracy are
transformers' own, computed here from the HF model's logits at every placeholder (over the
reward tokens, or over the whole vocabulary without them, and with LoRA adapters that start
at zero), at TP2 with sequence parallelism; bad flags and data are one line before start."""

from __future__ import annotations

import os

import pytest
import torch

from anyspeed.testing import run_distributed
from helpers import sft_ranks
from helpers.corpora import read_back
from helpers.prm import PLACEHOLDER, REWARDS

TOL = 1e-5
ROWS = 16  # step_data's rows: one global batch of them all has a mean that does not
# depend on the sample order


def cli(hf: str, prefix: str, tok: str, *extra: str, iters: int = 2, gbs: int = ROWS,
        rewards: bool = True) -> list[str]:  # fmt: skip
    steps = ["--reward-tokens", *REWARDS] if rewards else []
    return ["--stage", "prm", "--load", hf, "--finetune", "--data-path", prefix,
            "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", tok,
            "--placeholder-token", PLACEHOLDER, *steps, "--seq-length", "64",
            "--micro-batch-size", "4", "--global-batch-size", str(gbs), "--train-iters",
            str(iters), "--lr", "1e-4", "--split", "100,0,0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
            "--no-progress-bar", "--seed", "7", *extra]  # fmt: skip


def hf_steps(hf_dir: str, prefix: str, tok: str, rewards: bool) -> tuple[float, float]:
    """transformers: the mean loss and accuracy over every labelled step of the data, from
    the logits at each placeholder (the reward tokens' only, or the whole vocabulary's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    ids_of = [t(r, add_special_tokens=False)["input_ids"][0] for r in REWARDS]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    losses, hits = [], []
    for ids, lab in zip(read_back(f"{prefix}_packed_input_ids_document"),
                        read_back(f"{prefix}_packed_labels_document"), strict=True):  # fmt: skip
        lab_t = torch.tensor(lab)
        at = lab_t != -100
        assert (
            torch.tensor(ids)[at] == t(PLACEHOLDER, add_special_tokens=False)["input_ids"][0]
        ).all()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()[at]
        if rewards:
            logits = logits[:, ids_of]
            target = (lab_t[at][:, None] == torch.tensor(ids_of)).long().argmax(-1)
        else:
            target = lab_t[at]
        lp = torch.log_softmax(logits, -1)
        losses += (-lp.gather(1, target[:, None])[:, 0]).tolist()
        hits += (logits.argmax(-1) == target).double().tolist()
    return sum(losses) / len(losses), sum(hits) / len(hits)


def test_first_step_is_transformers_at_tp2(step_data, tiny_qwen, hf_tok):
    """TP2 + SP: reward tokens, the whole vocabulary, and LoRA (adapters start at zero, so its
    first step is the base model's); each second step has learned."""
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    lora = ["--lora-target-modules", "linear_qkv", "linear_proj", "--lora-r", "4"]
    clis = [cli(tiny_qwen, step_data, hf_tok, *tp),
            cli(tiny_qwen, step_data, hf_tok, *tp, rewards=False),
            cli(tiny_qwen, step_data, hf_tok, *tp, *lora)]  # fmt: skip
    runs = run_distributed(sft_ranks.posttrain_many, 2, argv=clis[0], clis=clis, timeout=300)[0]
    for run, rewards in zip(runs, (True, False, True), strict=True):
        loss, acc = hf_steps(tiny_qwen, step_data, hf_tok, rewards)
        assert run["loss"][0] == pytest.approx(loss, abs=TOL)
        assert run["metrics"]["acc"][0] == pytest.approx(acc, abs=1e-9)
        assert run["loss"][1] < run["loss"][0]


def _error(capsys, argv: list[str]) -> str:
    from anyspeed.commands.train import posttrain as main

    os.environ.pop("WORLD_SIZE", None)
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("anyspeed posttrain")]
    assert len(err) == 1, err
    return err[0]


def test_bad_flags_and_data_are_one_line(capsys, step_data, sft_data, tiny_qwen, hf_tok):
    argv = cli(tiny_qwen, step_data, hf_tok)
    swap = argv.index("--placeholder-token") + 1
    err = _error(capsys, [*argv[:swap], "ки", *argv[swap + 1 :]])
    assert "--placeholder-token 'ки' is 4 tokens" in err
    err = _error(capsys, [*argv[:swap], "+", *argv[swap + 1 :]])
    assert "--reward-tokens must be distinct, and differ from --placeholder-token" in err
    err = _error(capsys, cli(tiny_qwen, step_data, hf_tok, "--reward-tokens", "+", "="))
    assert "label token ids" in err and "are not --reward-tokens" in err
    err = _error(capsys, cli(tiny_qwen, sft_data["padded"], hf_tok))
    assert "labels sit on tokens other than --placeholder-token" in err
    at = argv.index("--tokenizer-type")
    err = _error(capsys, argv[:at] + argv[at + 4 :])
    assert "pass --tokenizer-type PretrainedFromHF --tokenizer-name-or-path DIR" in err
