"""Partial rollout (``--partial-rollout-max-split``): the buffer's schedule against one worked
out by hand from MindSpeed-RL's rule (rounds until enough groups are done, the oldest taken,
the rest carried); answers continued over rounds equal answers sampled whole (a deterministic
continuation, and the real model greedily); the first round of a sampled answer is the
rollout's without partial rollout; in a run, stitched log-probs are the training forward's
at lr 0 and stale once it learns; a resumed run continues the buffer exactly; bad flags are
one line; TP2, PP2 and DP2 equal one process (``-m slow``)."""

from __future__ import annotations

import pytest
import test_ppo
from test_grpo import cli, one_and_layouts
from test_grpo_resume import resume_clis

from anyspeed.stages.common.rl.partial import Buffer, PartialConfig
from anyspeed.testing import run_distributed
from helpers import sft_ranks

EOS = 0
TOL = 1e-5
RUN = ["--verifier-function", "helpers.user_rewards:vowels", "--lr-decay-style", "constant",
       "--ppo-epochs", "2", "--rollout-batch-size", "4",
       "--partial-rollout-max-split", "4"]  # fmt: skip


def _scripted(lengths: dict[int, int], calls: list | None = None):
    """A continuation whose answer to prompt key ``k`` is ``lengths[k]`` tokens ending in EOS
    (when shorter than the limit): token j of it is ``100 * k + j``."""

    def cont(items, budget):
        if calls is not None:
            calls.append((budget, [(f.key, len(f.answers[i].tokens)) for f, i in items]))
        out = []
        for f, i in items:
            have, want = len(f.answers[i].tokens), lengths[f.key]
            new = [100 * f.key + j for j in range(have, min(want, have + budget))]
            if have + len(new) == want and want < 10:
                new[-1] = EOS
            out.append((new, [-0.5] * len(new)))
        return out

    return cont


def _prompts(batch: int) -> list[tuple[int, int]]:
    return [(10 + k, k) for k in (2 * batch, 2 * batch + 1)]  # (row, key), two per batch


def test_schedule_matches_one_worked_out_by_hand():
    """Two groups per rollout, one sample each, max 10 tokens in rounds of 5 (split 2).

    rollout 0 holds keys 0-3 (lengths 3, 10, 10, 7): round 1 ends key 0 only, round 2 ends
    1, 2 and 3; keys 0 and 1 train; 2 and 3 wait (done). rollout 1 adds keys 4, 5 (10, 1):
    one round (always at least one) ends 5 and leaves 4 at 5 tokens; 2 and 3 train at age 1.
    rollout 2 adds 6, 7 (2, 2): one round ends 4, 6 and 7; 4 and 5 train at age 1."""
    lengths = {0: 3, 1: 10, 2: 10, 3: 7, 4: 10, 5: 1, 6: 2, 7: 2}
    buf = Buffer(PartialConfig(2, 5), 1, 2, (EOS,))
    want = [([0, 1], [0, 0], 2, 30, 2), ([2, 3], [1, 1], 1, 6, 2), ([4, 5], [1, 1], 1, 9, 2)]
    for at, (keys, ages, rounds, generated, carried) in enumerate(want):
        d = buf.draw(at, _prompts, _scripted(lengths), 10)
        assert [f.key for f in d.flights] == keys
        assert [f.row for f in d.flights] == [10 + k for k in keys]
        assert [f.age for f in d.flights] == ages
        assert (d.rounds, d.generated, d.carried) == (rounds, generated, carried)
        for f in d.flights:  # whole answers: the scripted tokens, EOS-terminated when short
            a = f.answers[0]
            assert len(a.tokens) == lengths[f.key] == len(a.logps)
            assert a.tokens[:-1] == [100 * f.key + j for j in range(lengths[f.key] - 1)]
    assert d.stats() == [1.0, 1, 2, 1, 9]


def test_remainder_rounds_and_a_saved_buffer():
    """Max 10 in a split of 4: rounds of 3, 3, 3 and a last call of 1; no answer is older
    than split - 1; a buffer saved and loaded draws the same as the one kept."""
    calls: list = []
    lengths = dict.fromkeys(range(40), 10)
    buf = Buffer(PartialConfig(4, 3), 2, 2, (EOS,))
    for at in range(6):
        state = buf.state()
        twin = Buffer(PartialConfig(4, 3), 2, 2, (EOS,))
        twin.load(state)
        d = buf.draw(at, _prompts, _scripted(lengths, calls), 10)
        e = twin.draw(at, _prompts, _scripted(lengths), 10)
        assert [(f.key, f.age, [a.tokens for a in f.answers]) for f in d.flights] == [
            (f.key, f.age, [a.tokens for a in f.answers]) for f in e.flights
        ]
        assert max(f.age for f in d.flights) <= 3
        assert all(len(a.tokens) == 10 for f in d.flights for a in f.answers)
    assert {b for b, _ in calls} == {3, 1}
    assert all(have == 9 for b, items in calls if b == 1 for _, have in items)


def _greedy(*extra: str) -> list[str]:
    return ["--top-k", "1", *extra]


def test_continued_answers_equal_whole_ones(add_prompts, tiny_qwen, hf_tok):
    """The first rollout of the tiny Qwen2 over rounds of 4 tokens: greedily, every answer
    equals the one sampled whole (log-probs within 1e-5); sampled at temperature 1, each
    answer's first round equals the first 4 tokens of the whole one (the same seeds)."""
    greedy = cli(tiny_qwen, add_prompts, hf_tok, *RUN, *_greedy())
    sampled = cli(tiny_qwen, add_prompts, hf_tok, *RUN)
    for argv in (greedy, sampled):
        got = run_distributed(sft_ranks.partial_draw, 1, argv=argv, cli=argv, timeout=300)[0]
        assert len(got["partial"]) == 4 * 4  # four groups of four
        assert max(p["rounds"] for p in got["partial"]) > 1  # continued over rounds of 4
        for part, whole in zip(got["partial"], got["whole"], strict=True):
            if argv is greedy:
                assert part["tokens"] == whole["tokens"]
                assert part["logps"] == pytest.approx(whole["logps"], abs=TOL)
            else:
                assert part["tokens"][:4] == whole["tokens"][:4]


def test_run_stitches_log_probs_and_resumes_exactly(add_prompts, tiny_qwen, hf_tok, tmp_path):
    """lr 0: the stitched rollout log-probs are the recomputed ones within 1e-5 (GRPO, and
    PPO with its critic) and every group after the first rollout was carried over; learning,
    tokens sampled by an older policy differ from the new one's. 4 steps straight equal 2
    saved + 2 resumed."""
    lr0 = cli(tiny_qwen, add_prompts, hf_tok, *RUN, "--lr", "0", iters=4)
    ppo = test_ppo.cli(tiny_qwen, add_prompts, hf_tok, "--partial-rollout-max-split", "4",
                       "--lr", "0", "--rollout-batch-size", "4", iters=4)  # fmt: skip
    clis = [lr0, ppo, *resume_clis(tiny_qwen, add_prompts, hf_tok, RUN, str(tmp_path / "ck"))]
    zero, critic, whole, a, b = run_distributed(sft_ranks.posttrain_many, 1, argv=lr0,
                                                clis=clis, timeout=300)[0]  # fmt: skip
    # PPO: the critic's values and GAE read the stitched answers as they read whole ones
    assert max(critic["metrics"]["rollout/logp_mismatch_max"]) <= TOL
    assert critic["metrics"]["partial_rollout/age"][-1] == 1.0
    m = zero["metrics"]
    assert max(m["rollout/logp_mismatch_max"]) <= TOL
    assert m["partial_rollout/age"][2:] == [1.0, 1.0]  # rollout 1 trains rollout 0's leftovers
    assert m["partial_rollout/carried_groups"] == [4.0] * 4
    assert min(m["partial_rollout/rounds"]) >= 1
    assert max(whole["metrics"]["rollout/logp_mismatch_max"][2:]) > 10 * TOL
    assert a["loss"] + b["loss"] == whole["loss"]
    assert a["grad_norm"] + b["grad_norm"] == whole["grad_norm"]
    r = "grpo/rewards/mean"
    assert a["metrics"][r] + b["metrics"][r] == whole["metrics"][r]


def test_mindspeed_rl_config_key(add_prompts, tiny_qwen, hf_tok, tmp_path):
    """MindSpeed-RL's ``rl_config: partial_rollout_max_split`` stands in for the flag: 16
    tokens in a split of 3 are rounds of 6."""
    from anyspeed.stages.prepare import prepare

    yaml = tmp_path / "rl.yaml"
    yaml.write_text("rl_config:\n  partial_rollout_max_split: 3\n")
    run, _ = prepare(cli(tiny_qwen, add_prompts, hf_tok, "--rl-config", str(yaml)), "launcher",
                     "posttrain")  # fmt: skip
    assert run.config.partial == PartialConfig(3, 6)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--partial-rollout-max-split", "17"], "exceeds --max-response-length 16"),
        (["--partial-rollout-max-split", "0"], "--partial-rollout-max-split"),
        (["--partial-rollout-max-split", "2", "--filter-groups"], "--filter-groups is not"),
        (
            ["--partial-rollout-max-split", "2", "--tools", "helpers.user_tools:multiply"],
            "--tools is not supported",
        ),  # fmt: skip
    ],
)
def test_bad_flags_are_one_line(extra, message, add_prompts, tiny_qwen, hf_tok, capsys):
    from test_prm import _error

    assert message in _error(capsys, cli(tiny_qwen, add_prompts, hf_tok, *extra))


INFER_1 = ["--infer-tensor-parallel-size", "1", "--infer-pipeline-parallel-size", "1",
           "--infer-expert-parallel-size", "1"]  # fmt: skip
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2-rollout-tp1": ["--tensor-model-parallel-size", "2", *INFER_1],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": ["--use-distributed-optimizer"],
}


@pytest.mark.slow
def test_layouts_equal_one_process(add_prompts, tiny_qwen, hf_tok):
    """The global buffer draws the same groups at every layout (DP2: each round's answers
    split over the replicas; TP2 rolling out at TP1 x DP2: the rollout model's share of the
    rows): 4 steps within 1e-5 of one process."""
    one = cli(tiny_qwen, add_prompts, hf_tok, *RUN, iters=4)
    argvs = [cli(tiny_qwen, add_prompts, hf_tok, *RUN, *f, iters=4) for f in LAYOUTS.values()]
    ref, out = one_and_layouts(one, argvs)
    for name, got in zip(LAYOUTS, out, strict=True):
        for k in ("grpo/rewards/mean", "partial_rollout/age", "partial_rollout/rounds"):
            assert got["metrics"][k] == ref["metrics"][k], (name, k)
        assert got["loss"] == pytest.approx(ref["loss"], rel=TOL, abs=1e-7), name
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL), name


@pytest.fixture(scope="module")
def early_eos_moe(tiny_moe, hf_tok, tmp_path_factory) -> str:
    """The tiny Qwen3-MoE with its output row of the EOS along the mean final hidden state,
    scaled until answers end at about 5% of their tokens: answers of many lengths, and rounds
    whose unfinished answers do not split evenly over two replicas."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    eos = AutoTokenizer.from_pretrained(hf_tok).eos_token_id
    model = AutoModelForCausalLM.from_pretrained(tiny_moe)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 400, (8, 24), generator=gen)
    with torch.no_grad():
        h = model(ids, output_hidden_states=True).hidden_states[-1]
        row = h.reshape(-1, h.shape[-1]).mean(0)
        for _ in range(20):  # double the row until an answer ends at ~5% of its tokens
            model.lm_head.weight[eos] = row
            if model(ids).logits.softmax(-1)[..., eos].mean() > 0.05:
                break
            row = row * 2
    d = str(tmp_path_factory.mktemp("eos_moe"))
    model.save_pretrained(d)
    return d


@pytest.mark.slow
def test_moe_at_ep2_equals_one_process(add_prompts, hf_tok, early_eos_moe):
    """A Qwen3-MoE at EP2 decodes in lockstep across the replicas: a round's shares are
    padded to one row count (rounds of odd counts); the same rollouts, loss and grad norm as
    one process."""
    from anyspeed.convert import hf_cache as hf_load

    one = cli(early_eos_moe, add_prompts, hf_tok, *RUN, "--init-kl-coef", "0", iters=4)
    ep = one + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    ref, (two,) = one_and_layouts(one, [hf_load.expand(ep, early_eos_moe)])
    lengths = ref["metrics"]["response_length/min"] + ref["metrics"]["response_length/mean"]
    assert min(lengths) < 16  # answers ended early: rounds of odd counts
    for k in ("grpo/rewards/mean", "partial_rollout/age", "partial_rollout/rounds"):
        assert two["metrics"][k] == ref["metrics"][k], k
    assert two["loss"] == pytest.approx(ref["loss"], rel=TOL, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL)
