"""Rewards from a process reward model (``--process-reward-model``): each sampled answer cut
into steps at the separator, a placeholder after each, scored by the frozen PRM through the
rollout's own path as transformers scores the same sequences (step probabilities of ``+``
among ``+ -`` at the placeholders, combined by min, mean, last and product) within 1e-5 at
TP2 (and PP2, slow); a PRM trained by ``--stage prm`` gives its tokens to GRPO from its
record (slow); bad flags are one line."""

from __future__ import annotations

import math

import pytest
import torch
from test_grpo import cli
from test_prm import _error

from anyspeed.testing import run_distributed
from helpers import sft_ranks
from helpers.corpora import read_back
from helpers.prm import PLACEHOLDER, REWARDS

TOL = 1e-5
STEPS = ["--prm-placeholder-token", PLACEHOLDER, "--prm-reward-tokens", *REWARDS]
ANSWERS = ["3 + 1 = 4\n4 + 1 = 6\n6 + 1 = 7", "5 + 1 = 6", "\n\n2 + 1 = 3\n\n", "", "9 + 1 = 10\n"]


def hf_steps(hf_dir: str, tok: str, prompts, answers, eos: set, sep: str = "\n") -> list:
    """transformers: the documented layout built here (the answer's text cut at ``sep``,
    each non-empty step followed by " @", joined by ``sep``, after the prompt's tokens); per
    answer, (the first answer token whose prefix text holds the step, found by a linear scan;
    the PRM's probability of "+" among "+ -" at the step's placeholder) for each step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    tag = t(PLACEHOLDER, add_special_tokens=False)["input_ids"][0]
    cand = [t(r, add_special_tokens=False)["input_ids"][0] for r in REWARDS]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    for p, a in zip(prompts, answers, strict=True):
        body = a[:-1] if a and a[-1] in eos else a
        text = t.decode(body)
        ends, at = [], 0
        for part in text.split(sep):
            if part.strip():
                end = at + len(part.rstrip())
                ends.append(
                    next(i for i in range(len(body)) if len(t.decode(body[: i + 1])) >= end)
                )
            at += len(part) + len(sep)
        steps = [x.strip() for x in text.split(sep) if x.strip()]
        ids = t(sep.join(f"{x} {PLACEHOLDER}" for x in steps), add_special_tokens=False)
        ids = ids["input_ids"] if steps else []
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + ids])).logits[0, len(p) :].double()
        at_tag = torch.tensor(ids) == tag if ids else torch.zeros(0, dtype=torch.bool)
        q = torch.softmax(logits[at_tag][:, cand], -1)[:, 0].tolist() if ids else []
        out.append(list(zip(ends, q, strict=True)))
    return out


def combined(steps: list) -> dict[str, list[float]]:
    """Each answer's step scores combined four ways (0 without a step)."""
    out: dict[str, list[float]] = {"min": [], "mean": [], "last": [], "prod": []}
    for s in steps:
        q = [v for _, v in s]
        out["min"].append(min(q) if q else 0.0)
        out["mean"].append(sum(q) / len(q) if q else 0.0)
        out["last"].append(q[-1] if q else 0.0)
        out["prod"].append(math.prod(q) if q else 0.0)
    return out


def _sequences(prefix: str, tok: str) -> tuple[list[list[int]], list[list[int]], set]:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    prompts = [list(map(int, p)) for p in read_back(f"{prefix}_packed_input_ids_document")]
    answers = [t(a, add_special_tokens=False)["input_ids"] for a in ANSWERS]
    answers[1] = answers[1] + [t.eos_token_id]  # a sampled end token is not a step's
    return prompts[: len(answers)], answers, {t.eos_token_id}


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    pytest.param(["--pipeline-model-parallel-size", "2"], marks=pytest.mark.slow),
], ids=["tp2-sp", "pp2"])  # fmt: skip
def test_step_scores_equal_transformers(add_prompts, tiny_qwen, hf_tok, layout, tmp_path):
    """An HF *ForCausalLM directory as the PRM (converted once), 5 answers in micro-batches
    of 4: several steps, a sampled end token, blank lines, an empty answer (0), one step."""
    prompts, answers, eos = _sequences(add_prompts, hf_tok)
    argv = cli(tiny_qwen, add_prompts, hf_tok, "--process-reward-model", tiny_qwen, *STEPS,
               *layout, "--seq-length", "128", "--save", str(tmp_path / "run"))  # fmt: skip
    got = run_distributed(sft_ranks.process_reward_scores, 2, argv=argv, cli=argv,
                          prompts=prompts, answers=answers, timeout=300)  # fmt: skip
    steps = hf_steps(tiny_qwen, hf_tok, prompts, answers, eos)
    want = combined(steps)
    assert want["min"][3] == 0.0 and 0.0 < want["prod"][0] < want["min"][0] < 1.0
    assert [len(s) for s in steps] == [3, 1, 1, 0, 1]
    for rank in got:  # every rank has the scores
        for how in want:
            assert rank[how] == pytest.approx(want[how], abs=TOL), how
        for s, w in zip(rank["steps"], steps, strict=True):
            assert [e for e, _ in s] == [e for e, _ in w]
            assert [v for _, v in s] == pytest.approx([v for _, v in w], abs=TOL)


def test_ppo_step_rewards_sit_where_the_steps_end(add_prompts, tiny_qwen, hf_tok, tmp_path):
    """PPO with ``--prm-step-rewards`` (steps cut at spaces, so sampled answers have several):
    each answer token's reward is --prm-weight x the score of each step ending there, as
    transformers scores it, 0 elsewhere; the sequence reward holds no PRM score."""
    from transformers import AutoTokenizer

    ppo = cli(tiny_qwen, add_prompts, hf_tok, "--process-reward-model", tiny_qwen, *STEPS,
              "--prm-step-rewards", "--prm-weight", "2", "--prm-step-separator", " ",
              "--seq-length", "128", "--save", str(tmp_path / "run"))  # fmt: skip
    ppo[ppo.index("--stage") + 1] = "ppo"
    keys = ("tokens", "labels", "loss_mask", "token_rewards", "scores")
    micro = run_distributed(sft_ranks.rollout_batches, 1, argv=ppo, cli=ppo, rows=[0, 1],
                            keys=keys, timeout=300)[0]  # fmt: skip
    eos = set(AutoTokenizer.from_pretrained(hf_tok).all_special_ids)  # sampling stops at any
    assert all(b["scores"] == [0.0] * len(b["scores"]) for b in micro)
    got = [r for b in micro for r in b["token_rewards"]]
    steps_seen = 0
    for (prompt, answer, first), row in zip(_answers(micro), got, strict=True):
        (steps,) = hf_steps(tiny_qwen, hf_tok, [prompt], [answer], eos, " ")
        want = [0.0] * len(row)
        for end, score in steps:
            want[first + end] += 2 * score
        assert row == pytest.approx(want, abs=TOL)
        steps_seen += len(steps)
    assert steps_seen > len(got)  # several steps an answer


def _answers(micro: list[dict]) -> list[tuple[list[int], list[int], int]]:
    """Each rollout row's (prompt, answer, first label position), in rollout order."""
    out = []
    for b in micro:
        for tokens, labels, mask in zip(b["tokens"], b["labels"], b["loss_mask"], strict=True):
            at = [i for i, m in enumerate(mask) if m > 0]
            out.append((tokens[: at[0] + 1], [labels[i] for i in at], at[0]))
    return out


def test_step_advantages_are_deepseekmath_process_supervision():
    """Two groups of two: the steps' scores (x weight) normalised over the group's steps with
    the unbiased std, each token's advantage the sum over the steps ending at or after it,
    plus the outcome advantage; written out token by token."""
    from anyspeed.stages.common.rl.process_reward import step_advantages

    steps = [[(1, 0.9), (4, 0.2)], [(2, 0.6)], [], [(0, 0.3), (1, 0.3), (3, 0.8)]]
    lengths, outcome, w = [6, 3, 2, 5], torch.tensor([0.5, -0.5, 0.0, 0.25]), 2.0
    got = step_advantages(steps, lengths, 2, outcome, w, "group_norm")
    for g in (0, 2):
        r = torch.tensor([w * v for s in steps[g : g + 2] for _, v in s], dtype=torch.float64)
        norm = iter(((r - r.mean()) / (r.std() + 1e-6)).tolist())
        for i in (g, g + 1):
            want = [float(outcome[i])] * lengths[i]
            for end, _ in steps[i]:
                n = next(norm)
                want = [a + (n if t <= end else 0.0) for t, a in enumerate(want)]
            assert got[i] == pytest.approx(want, abs=1e-12)
    assert got[2] == [0.0, 0.0]  # no step, outcome 0
    mean = step_advantages(steps, lengths, 2, torch.zeros(4), 1.0, "group_mean")
    assert mean[1] == pytest.approx([0.6 - (0.9 + 0.2 + 0.6) / 3] * 3)


def test_grpo_process_supervision_advantages(add_prompts, tiny_qwen, hf_tok, tmp_path):
    """GRPO with ``--prm-step-rewards`` (steps cut at spaces) and no rule reward: every answer
    token's advantage in the rollout's micro-batches is the process-supervision sum built here
    from transformers' step scores, normalised per group of 4, within 1e-4."""
    from transformers import AutoTokenizer

    grpo = cli(tiny_qwen, add_prompts, hf_tok, "--process-reward-model", tiny_qwen, *STEPS,
               "--prm-step-rewards", "--prm-step-separator", " ", "--seq-length", "128",
               "--save", str(tmp_path / "run"))  # fmt: skip
    keys = ("tokens", "labels", "loss_mask", "advantages")
    micro = run_distributed(sft_ranks.rollout_batches, 1, argv=grpo, cli=grpo, rows=[0, 1],
                            keys=keys, timeout=300)[0]  # fmt: skip
    eos = set(AutoTokenizer.from_pretrained(hf_tok).all_special_ids)
    rows = _answers(micro)
    steps = [hf_steps(tiny_qwen, hf_tok, [p], [a], eos, " ")[0] for p, a, _ in rows]
    got = [adv for b in micro for adv in b["advantages"]]
    for g in range(0, len(rows), 4):
        r = torch.tensor([v for s in steps[g : g + 4] for _, v in s], dtype=torch.float64)
        norm = iter(((r - r.mean()) / (r.std() + 1e-6)).tolist())
        for i in range(g, g + 4):
            first, want = rows[i][2], [0.0] * len(got[i])
            for end, _ in steps[i]:
                n = next(norm)
                for t in range(end + 1):
                    want[first + t] += n
            mask = [m for b in micro for m in b["loss_mask"]][i]
            assert [a * m for a, m in zip(got[i], mask, strict=True)] == pytest.approx(
                want, abs=1e-4
            )


def test_memory_counts_the_process_reward_model(tiny_qwen, tmp_path):
    """``anyspeed memory --process-reward-model``: the PRM's frozen bytes at one process are
    the HF model's own parameters in fp32, and the report has its line beside a teacher's."""
    from transformers import AutoModelForCausalLM

    from anyspeed.commands.memory import _frozen_model, run
    from anyspeed.layout import Layout
    from anyspeed.models.memory import frozen_bytes
    from helpers.instruction import VOCAB

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32)
    model = _frozen_model("--process-reward-model", tiny_qwen)
    assert frozen_bytes(model, Layout(), 0, 4) == 4 * sum(p.numel() for p in hf.parameters())
    flags = ["--model", "tiny-qwen2.5", "--seq-length", "64", "--vocab-size", str(VOCAB)]
    out = run([*flags, "--process-reward-model", tiny_qwen, "--teacher-model", tiny_qwen])
    assert "PRM (--process-reward-model): frozen parameters" in out
    assert "teacher (--teacher-model" in out and "peak with them" in out


def test_bad_flags_are_one_line(capsys, add_prompts, tiny_qwen, hf_tok, tmp_path):
    base = cli(tiny_qwen, add_prompts, hf_tok, "--process-reward-model")
    err = _error(capsys, [*base, str(tmp_path / "none"), *STEPS])
    assert "--process-reward-model" in err and "is not a directory" in err
    err = _error(capsys, [*base, tiny_qwen, "--prm-placeholder-token", "ки"])
    assert "--prm-placeholder-token 'ки' is 4 tokens" in err
    err = _error(capsys, [*base, tiny_qwen, "--prm-placeholder-token", "@",
                          "--prm-reward-tokens", "+"])  # fmt: skip
    assert "--prm-reward-tokens: give two or more" in err
    err = _error(capsys, [*base, tiny_qwen, *STEPS, "--prm-weight", "nan"])
    assert "--prm-weight" in err
    err = _error(capsys, [*base, tiny_qwen, *STEPS, "--prm-step-rewards",
                          "--importance-sampling-level", "sequence"])  # fmt: skip
    assert "GSPO's sequence ratio takes one advantage per sequence" in err
    err = _error(capsys, [*base[:-1], "--prm-step-rewards"])
    assert "--prm-step-rewards needs --process-reward-model" in err


@pytest.mark.slow
def test_grpo_trains_on_a_trained_prm(add_prompts, step_data, tiny_qwen, hf_tok, tmp_path):
    """A PRM trained by ``--stage prm`` (saved) scores GRPO's samples with the tokens its
    checkpoint records (no step flags given): the reward is the PRM's alone (no rule reward by
    default), a probability, and differs between samples; PPO takes it too, both take it as
    step credit, and GRPO takes its Hugging Face export, whose config.json carries the tokens,
    with the same rewards."""
    from test_prm import cli as prm_cli

    from anyspeed.convert import megatron_to_hf

    train = prm_cli(tiny_qwen, step_data, hf_tok, "--save", str(tmp_path / "prm"), iters=2)
    run_distributed(sft_ranks.posttrain, 1, argv=train, cli=train, timeout=300)
    hf = str(megatron_to_hf(tmp_path / "prm", tmp_path / "prm-hf", tiny_qwen))
    flags = ["--seq-length", "128", "--process-reward-model"]
    grpo = cli(tiny_qwen, add_prompts, hf_tok, *flags, str(tmp_path / "prm"))
    ppo = cli(tiny_qwen, add_prompts, hf_tok, *flags, str(tmp_path / "prm"))
    ppo[ppo.index("--stage") + 1] = "ppo"
    from_hf = cli(tiny_qwen, add_prompts, hf_tok, *flags, hf)
    dense = [[*ppo, "--prm-step-rewards"], [*grpo, "--prm-step-rewards"]]
    runs = run_distributed(sft_ranks.posttrain_many, 1, argv=grpo,
                           clis=[grpo, ppo, from_hf, *dense], timeout=400)[0]  # fmt: skip
    for run in runs[:3]:
        m = run["metrics"]
        assert 0.0 <= m["grpo/rewards/min"][0] < m["grpo/rewards/max"][0] <= 1.0
    for run in runs[3:]:  # the steps' scores are token rewards or advantages, not the reward's
        assert run["metrics"]["grpo/rewards/max"] == [0.0, 0.0]
        assert run["metrics"]["grpo/zero_adv_groups"] == [0.0, 0.0]
        assert run["grad_norm"][0] > 0
    for run in runs:  # the rollout's PRM statistics
        m = run["metrics"]
        assert all(0.0 < x < 1.0 for x in m["prm/step_score"]) and min(m["prm/steps"]) > 0.5
    got, want = runs[2]["metrics"], runs[0]["metrics"]
    assert got["grpo/rewards/mean"] == pytest.approx(want["grpo/rewards/mean"], abs=TOL)
