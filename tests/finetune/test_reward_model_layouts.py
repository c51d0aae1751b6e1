"""A reward model of another size than the policy (a smaller Qwen2
``*ForSequenceClassification`` reading the same tokens) scores rollout sequences as transformers
does (within 1e-5): at the training layout where it fits (one process, TP2+SP), and whole on
every rank (``--reward-tensor-parallel-size 1 --reward-pipeline-parallel-size 1``) under a TP2+SP
and a PP2 policy; where it does not fit the training layout the run is refused in one line
naming those flags."""

from __future__ import annotations

import os

import pytest
import torch
from test_grpo import cli
from test_reward_model import hf_scores, sequences

from anyspeed.testing import run_distributed
from helpers import sft_ranks
from helpers.instruction import VOCAB

TOL = 1e-5
WHOLE = ["--reward-tensor-parallel-size", "1", "--reward-pipeline-parallel-size", "1"]


@pytest.fixture(scope="module")
def small_rm(tmp_path_factory) -> str:
    """A random 3-layer Qwen2 reward model, hidden 32, one key-value head (the policy: 2
    layers, hidden 64, two), whose head gives scores well away from 0."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    d = str(tmp_path_factory.mktemp("rm-small"))
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, tie_word_embeddings=False, num_labels=1,
                      pad_token_id=0, rope_theta=10000.0)  # fmt: skip
    model = Qwen2ForSequenceClassification(cfg)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(d)
    return d


@pytest.mark.parametrize("layout", [
    [],
    pytest.param(["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                 marks=pytest.mark.slow),
    pytest.param(["--tensor-model-parallel-size", "2", "--sequence-parallel", *WHOLE],
                 marks=pytest.mark.slow),
    pytest.param(["--pipeline-model-parallel-size", "2", *WHOLE], marks=pytest.mark.slow),
], ids=["one", "tp2-sp", "tp2-sp-whole", "pp2-whole"])  # fmt: skip
def test_scores_equal_transformers(small_rm, add_prompts, tiny_qwen, hf_tok, layout, tmp_path):
    prompts, answers = sequences(add_prompts)
    argv = cli(tiny_qwen, add_prompts, hf_tok, "--reward-model", small_rm, *layout,
               "--save", str(tmp_path / "run"))  # fmt: skip
    ranks = 2 if layout else 1
    got = run_distributed(sft_ranks.reward_model_scores, ranks, argv=argv, cli=argv,
                          prompts=prompts, answers=answers, timeout=300)  # fmt: skip
    want = hf_scores(small_rm, prompts, answers)
    assert max(abs(w) for w in want) > 1e-2
    for rank in got:
        assert rank == pytest.approx(want, abs=TOL)


def test_a_layout_it_does_not_fit_is_refused(capsys, monkeypatch, small_rm, add_prompts,
                                             tiny_qwen, hf_tok, tmp_path):  # fmt: skip
    """Three layers do not split over two pipeline stages: refused before start, naming the
    flags that run it whole; under a launcher, and in anyspeed's own before it starts the
    ranks (which checked it against a world of one, refusing every such layout)."""
    from anyspeed.commands.train import posttrain

    argv = cli(tiny_qwen, add_prompts, hf_tok, "--reward-model", small_rm,
               "--pipeline-model-parallel-size", "2", "--save", str(tmp_path / "run"))  # fmt: skip
    for where in ("launcher", "ranks"):
        if where == "ranks":
            monkeypatch.setenv("WORLD_SIZE", "2")
        else:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        assert posttrain([*argv, "--nproc-per-node", "2"]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
        assert len(err) == 1 and "--reward-tensor-parallel-size 1" in err[0], err
        assert "--num-layers 3 is not divisible" in err[0], err
    assert not os.path.exists(tmp_path / "run" / "iter_0000001")
