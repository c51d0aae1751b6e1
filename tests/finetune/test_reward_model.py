"""Rewards from a trained reward model (``--reward-model``): an ``--stage orm`` checkpoint scores
rollout sequences, through the rollout's own path, as transformers'
``AutoModelForSequenceClassification`` scores the exported model (within 1e-5), at one process
and at PP2; GRPO and PPO train with it (alone or added to a rule reward); a checkpoint without a
reward head is refused in one line."""

from __future__ import annotations

import os
import random

import pytest
import torch
from test_grpo import cli

from anyspeed.testing import run_distributed
from helpers import sft_ranks
from helpers.corpora import read_back

TOL = 1e-5


@pytest.fixture(scope="module")
def orm(pair_data, tiny_qwen, tmp_path_factory) -> dict:
    """3 ORM steps from the tiny Qwen2, saved and exported as *ForSequenceClassification."""
    from test_dpo import cli as pair_cli

    from anyspeed.convert import megatron_to_hf

    d = tmp_path_factory.mktemp("rm")
    train = pair_cli(tiny_qwen, pair_data, "--save", str(d / "ck"), stage="orm", iters=3)
    run_distributed(sft_ranks.posttrain, 1, argv=train, cli=train, timeout=300)
    return {"ck": str(d / "ck"), "hf": str(megatron_to_hf(d / "ck", d / "hf", tiny_qwen))}


def sequences(prefix: str, n: int = 6) -> tuple[list[list[int]], list[list[int]]]:
    """The first prompts of the prompt data with random answers of different lengths."""
    rng = random.Random(3)
    prompts = read_back(f"{prefix}_packed_input_ids_document")[:n]
    answers = [[rng.randrange(4, 700) for _ in range(rng.randrange(1, 12))] for _ in prompts]
    return [list(map(int, p)) for p in prompts], answers


def hf_scores(hf_dir: str, prompts, answers) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([p + a])).logits[0, 0])
                for p, a in zip(prompts, answers, strict=True)]  # fmt: skip


@pytest.mark.parametrize(("source", "layout"), [
    pytest.param("ck", [], marks=pytest.mark.slow),  # fast: the HF case and the training one
    pytest.param("ck", ["--pipeline-model-parallel-size", "2"], marks=pytest.mark.slow),
    ("hf", ["--pipeline-model-parallel-size", "2"]),  # 6 sequences: a short last micro-batch
], ids=["one", "pp2", "hf-dir-pp2"])  # fmt: skip
def test_rollout_scores_equal_transformers(orm, add_prompts, tiny_qwen, hf_tok, source, layout,
                                           tmp_path):  # fmt: skip
    """The ORM checkpoint at one process and PP2, and its export given as an HF directory
    (converted once, as --load converts one) at PP2: 6 sequences in micro-batches of 4, so
    the last is short (its rows were read misaligned between stages before the fix)."""
    prompts, answers = sequences(add_prompts)
    argv = cli(tiny_qwen, add_prompts, hf_tok, "--reward-model", orm[source], *layout,
               "--save", str(tmp_path / "run"))  # fmt: skip
    ranks = 2 if layout else 1
    got = run_distributed(sft_ranks.reward_model_scores, ranks, argv=argv, cli=argv,
                          prompts=prompts, answers=answers, timeout=300)  # fmt: skip
    want = hf_scores(orm["hf"], prompts, answers)
    assert max(abs(w) for w in want) > 1e-3
    for rank in got:  # every rank has the scores (the last stage's, broadcast)
        assert rank == pytest.approx(want, abs=TOL)


def test_grpo_and_ppo_train_on_it(orm, add_prompts, tiny_qwen, hf_tok):
    """The reward model alone (no rule reward by default) and added to one: the reward's range
    is the reward model's, and a rule reward of weight 1 shifts it up by that reward."""
    rm = ["--reward-model", orm["ck"], "--lr", "0", "--init-kl-coef", "0"]
    alone = cli(tiny_qwen, add_prompts, hf_tok, *rm)
    plus = cli(tiny_qwen, add_prompts, hf_tok, *rm, "--verifier-function",
               "helpers.user_rewards:constant")  # fmt: skip
    ppo = cli(tiny_qwen, add_prompts, hf_tok, *rm)
    ppo[ppo.index("--stage") + 1] = "ppo"
    runs = run_distributed(sft_ranks.posttrain_many, 1, argv=alone, clis=[alone, plus, ppo],
                           timeout=400)[0]  # fmt: skip
    a, p = runs[0]["metrics"], runs[1]["metrics"]
    assert a["grpo/rewards/max"][0] > a["grpo/rewards/min"][0]  # scores, not a constant
    from helpers.user_rewards import constant

    c = constant([""], [""], [""])[0]
    assert p["grpo/rewards/mean"] == pytest.approx([x + c for x in a["grpo/rewards/mean"]])
    assert runs[2]["metrics"]["grpo/rewards/mean"][0] == pytest.approx(a["grpo/rewards/mean"][0])


def test_a_checkpoint_without_a_head_is_refused(capsys, add_prompts, tiny_qwen, hf_tok,
                                                tmp_path):  # fmt: skip
    from anyspeed.commands.train import posttrain

    os.environ.pop("WORLD_SIZE", None)
    assert posttrain(cli(tiny_qwen, add_prompts, hf_tok, "--reward-model", str(tmp_path))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a checkpoint directory" in err, err


def test_answers_are_closed_as_the_template_closes_a_turn():
    """The reward model reads an answer as its training pairs ended: the sampled end token
    replaced by the template's turn end (chatml: the tokens of ``<|im_end|>\\n``)."""
    from anyspeed.data.templates import TEMPLATES
    from anyspeed.stages.common.rl import reward_model as R

    class Tok:  # encodes each character as its code point
        eod_id = 0

        def encode(self, texts, special=True):
            return [[ord(ch) for ch in t] for t in texts]

    end = R.turn_end(Tok(), "chatml")
    assert end == [ord(ch) for ch in TEMPLATES["chatml"].assistant.split("{content}")[1]]
    assert R.closed([5, 6, 9], {9}, end) == [5, 6, *end]  # sampled end token replaced
    assert R.closed([5, 6], {9}, end) == [5, 6, *end]  # cut at the length limit: closed
    assert R.turn_end(Tok(), None) is None and R.closed([5, 9], {9}, None) == [5, 9]
