"""The process reward model at every layout SFT runs, and what it learns: loss, step accuracy
and grad norm of 3 steps at TP2+SP, PP2, DP2 (distributed optimizer) and CP2 equal one
process's within 1e-5; packed rows give transformers' loss; a model trained on one-digit
successor steps scores held-out steps well, and its Hugging Face export scores them as the
saved checkpoint does (its config.json carries the step tokens)."""

from __future__ import annotations

import json

import pytest
from test_prm import TOL, cli, hf_steps

from anyspeed.testing import run_distributed
from helpers import sft_ranks
from helpers.corpora import read_back
from helpers.prm import preprocess_steps, step_records

LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": ["--use-distributed-optimizer"],
    "cp2": ["--context-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def runs(step_data, tiny_qwen, hf_tok) -> dict[str, dict]:
    """3 steps of 8 samples at one process and at each two-rank layout."""
    one = cli(tiny_qwen, step_data, hf_tok, iters=3, gbs=8)
    ref = run_distributed(sft_ranks.posttrain, 1, argv=one, cli=one, timeout=300)[0]
    argvs = [cli(tiny_qwen, step_data, hf_tok, *f, iters=3, gbs=8) for f in LAYOUTS.values()]
    out = run_distributed(sft_ranks.posttrain_many, 2, argv=argvs[0], clis=argvs, timeout=600)
    return {"one": ref, **{name: out[0][i] for i, name in enumerate(LAYOUTS)}}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_one_process(layout, runs):
    got, want = runs[layout], runs["one"]
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
    assert got["metrics"]["acc"] == want["metrics"]["acc"]


@pytest.mark.slow
def test_packed_rows_give_transformers_loss(step_data, tiny_qwen, hf_tok, tmp_path):
    """step_data's samples neat-packed (two or three a row at 128 tokens), one global batch
    of them all: transformers' loss and accuracy on the samples one at a time."""
    prefix = preprocess_steps(step_records(16), str(tmp_path / "packed"), hf_tok, "--pack",
                              "--neat-pack", "--seq-length", "128")  # fmt: skip
    rows = len(read_back(f"{prefix}_packed_input_ids_document"))
    assert rows < 16
    argv = cli(tiny_qwen, prefix, hf_tok, "--neat-pack", "--optimization-level", "1",
               "--seq-length", "128", "--micro-batch-size", "1", iters=1, gbs=rows)  # fmt: skip
    run = run_distributed(sft_ranks.posttrain, 1, argv=argv, cli=argv, timeout=300)[0]
    loss, acc = hf_steps(tiny_qwen, step_data, hf_tok, True)
    assert run["loss"][0] == pytest.approx(loss, abs=TOL)
    assert run["metrics"]["acc"][0] == pytest.approx(acc, abs=1e-9)


@pytest.mark.slow
def test_learns_and_exports(tiny_qwen, hf_tok, tmp_path):
    """500 steps on successor chains (each step adds 1, a third of them written wrong): the
    held-out step accuracy beats a constant "+" (0.67) by more than 0.2; the HF export's
    own logits give the saved model's held-out loss and accuracy."""
    from anyspeed.convert import hf_cache, megatron_to_hf

    train = preprocess_steps(step_records(1024, seed=5, top=1), str(tmp_path / "t"), hf_tok)
    held_records = step_records(64, seed=6, top=1)
    held = preprocess_steps(held_records, str(tmp_path / "h"), hf_tok)
    labels = [v for r in held_records for v in r["value"]]
    constant = labels.count("+") / len(labels)
    fit = cli(tiny_qwen, train, hf_tok, "--lr", "3e-3", "--lr-decay-style", "constant",
              "--save", str(tmp_path / "ck"), "--save-interval", "500", iters=500)  # fmt: skip
    score = cli(str(tmp_path / "ck"), held, hf_tok, "--lr", "0", iters=1, gbs=64)
    score = hf_cache.expand(score, tiny_qwen)  # the saved model's architecture flags
    out = run_distributed(sft_ranks.posttrain_many, 1, argv=fit, clis=[fit, score],
                          timeout=600)[0]  # fmt: skip
    assert out[1]["metrics"]["acc"][0] > constant + 0.2
    assert sum(out[0]["loss"][-20:]) < 0.6 * sum(out[0]["loss"][:20])
    hf = megatron_to_hf(tmp_path / "ck", tmp_path / "hf", tiny_qwen)
    config = json.loads((hf / "config.json").read_text())
    assert config["anyspeed_prm"] == {"placeholder_token": "@", "reward_tokens": ["+", "-"]}
    loss, acc = hf_steps(str(hf), held, hf_tok, True)
    assert out[1]["loss"][0] == pytest.approx(loss, abs=TOL)
    assert out[1]["metrics"]["acc"][0] == pytest.approx(acc, abs=1e-9)
