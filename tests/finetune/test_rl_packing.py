"""Remove-padding and dynamic batch size in the RL stages (``--use-remove-padding``,
``--use-dynamic-bsz``): GRPO, PPO (its critic too) and top-k distillation packed equal the
same runs padded within 1e-5 over 4 steps (two passes over each rollout); at TP2+SP, PP2 and
DP2 the packed runs equal one padded process (``-m slow``); the packing helpers equal plain
indexing; bad flags are one line before any process group starts."""

from __future__ import annotations

import random

import pytest
import test_ppo
import torch
from test_distill import cli as distill_cli
from test_distill import teacher  # noqa: F401 - the teacher fixture
from test_grpo import cli, one_and_layouts

from anyspeed.stages.common.rl import packing as P
from anyspeed.testing import run_distributed
from anyspeed.training import packed_rows as R
from helpers import sft_ranks

TOL = 1e-5
RUN = ["--verifier-function", "helpers.user_rewards:vowels", "--ppo-epochs", "2",
       "--lr-decay-style", "constant", "--rollout-batch-size", "4",
       "--loss-agg-mode", "seq-mean-token-mean", "--optimization-level", "1"]  # fmt: skip
PACK = ["--use-remove-padding"]
DYNAMIC = [*PACK, "--use-dynamic-bsz", "--max-packing-token-size", "120"]


def _same(got: dict, want: dict, keys: tuple[str, ...] = ()) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
    for k in keys:
        assert got["metrics"][k] == pytest.approx(want["metrics"][k], rel=TOL, abs=1e-6), k
    assert max(got["metrics"]["rollout/logp_mismatch_max"]) <= TOL


def test_packed_grpo_equals_padded(add_prompts, tiny_qwen, hf_tok):
    """The same rollouts; loss, grad norm, KL and entropy within 1e-5 (per-sequence means:
    seq-mean-token-mean), packed by count and by a 120-token budget."""
    argvs = [cli(tiny_qwen, add_prompts, hf_tok, *RUN, *x, iters=4) for x in ([], PACK, DYNAMIC)]
    pad, pack, dyn = run_distributed(sft_ranks.posttrain_many, 1, argv=argvs[0], clis=argvs,
                                     timeout=300)[0]  # fmt: skip
    for got in (pack, dyn):
        assert got["metrics"]["grpo/rewards/mean"] == pad["metrics"]["grpo/rewards/mean"]
        _same(got, pad, ("actor/kl_loss", "actor/entropy", "actor/pg_clipfrac"))


def test_packed_ppo_and_distillation_equal_padded(add_prompts, tiny_qwen, hf_tok, teacher):  # noqa: F811
    """PPO (the critic's values, GAE and its own steps read packed sequences) and top-k
    distillation (the teacher's top tokens) packed with a dynamic batch size."""
    lvl = ["--optimization-level", "1", "--ppo-epochs", "2"]
    ppo = [test_ppo.cli(tiny_qwen, add_prompts, hf_tok, *lvl, *x, iters=4) for x in ([], DYNAMIC)]
    top = ["--distill-update", "topk", "--distill-topk", "8", *lvl]
    dis = [distill_cli(tiny_qwen, add_prompts, hf_tok, teacher, *top, *x) for x in ([], DYNAMIC)]
    runs = run_distributed(sft_ranks.posttrain_many, 1, argv=ppo[0], clis=ppo + dis,
                           timeout=400)[0]  # fmt: skip
    _same(runs[1], runs[0], ("critic/vf_loss", "critic/grad_norm", "critic/vf_explained_var"))
    _same(runs[3], runs[2], ("distill/reverse_kl",))


def test_split_by_tokens_is_a_balanced_partition():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(50, 160)
        parts = P.split(lengths, budget)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in p) for p in parts]
        assert max(loads) <= budget and all(p == sorted(p) for p in parts)
        assert len(parts) >= -(-sum(lengths) // budget)
        # one fewer micro-batch could not hold the tokens, or the longest-first split failed
        assert len(parts) == -(-sum(lengths) // budget) or max(loads) > budget - max(lengths)
        at_least = min(len(lengths), len(parts) + 2)
        assert len(P.split(lengths, budget, at_least)) == at_least  # no empty micro-batch


def test_steps_split_alone_and_equal_counts(monkeypatch):
    """With a dynamic batch size no micro-batch spans two optimizer steps; under EP every
    replica runs the most micro-batches any replica needs."""
    lengths = [30, 5, 5, 5, 40, 40, 40, 40]
    pack = P.Packing(80, 8, False, False)
    parts = P.groups(lengths, 4, 2, pack)
    assert [[i // 4 for i in p] for p in parts] == [[0, 0, 0, 0], [1, 1], [1, 1]]
    monkeypatch.setattr(P, "_max_over_ranks", lambda v: [x + 1 for x in v])
    parts = P.groups(lengths, 4, 2, P.Packing(80, 8, True, True))
    assert len(parts) == 5 and sorted(i for p in parts for i in p) == list(range(8))


def test_packed_rows_are_plain_indexing():
    """pack / to_rows / to_packed against the sequences laid end to end by hand; the
    gradient of the rows flows back to the packed output."""
    g = torch.Generator().manual_seed(0)
    lengths = [5, 2, 7]
    tokens = torch.randint(1, 99, (3, 7), generator=g)
    labels = torch.randint(1, 99, (3, 7), generator=g)
    b = {"tokens": tokens, "labels": labels}
    R.pack(b, lengths, 16)
    want = [int(t) for row, n in zip(tokens, lengths, strict=True) for t in row[:n]]
    assert b["packed_tokens"][0].tolist() == want + [0] * 2
    assert b["cu_seqlens"].tolist() == [0, 5, 7, 14, 16]
    assert b["packed_position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, *range(7), 0, 1]
    x = torch.randn(2, 1, 16, generator=g, requires_grad=True)
    rows = R.to_rows(x, b)
    for i, n in enumerate(lengths):
        start = sum(lengths[:i])
        assert torch.equal(rows[:, i, :n], x[:, 0, start : start + n])
        assert not rows[:, i, n:].any()
    rows.sum().backward()
    assert x.grad[0, 0].tolist() == [1.0] * 14 + [0.0] * 2
    ids = torch.randint(0, 9, (3, 7, 4), generator=g)
    flat = R.to_packed(ids, b)
    assert flat.shape == (1, 16, 4) and torch.equal(R.to_rows(flat, b, 1)[0, :5], ids[0, :5])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--use-dynamic-bsz"], "pack sequences: add --use-remove-padding"),
        ([*PACK, "--max-packing-token-size", "200"], "budget: add that flag"),
        ([*PACK, "--optimization-level", "0"], "--optimization-level 1 or higher"),
        ([*DYNAMIC[:-1], "64"], "below --seq-length 96"),
        ([*DYNAMIC[:-1], "0"], "--max-packing-token-size"),
    ],
)
def test_bad_flags_are_one_line(extra, message, add_prompts, tiny_qwen, hf_tok, capsys):
    from test_prm import _error

    assert message in _error(capsys, cli(tiny_qwen, add_prompts, hf_tok, *extra))


LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel", *PACK],
    "pp2": ["--pipeline-model-parallel-size", "2", *DYNAMIC],
    "dp2": ["--use-distributed-optimizer", *DYNAMIC],
}


@pytest.mark.slow
def test_packed_layouts_equal_one_padded_process(add_prompts, tiny_qwen, hf_tok):
    """TP2+SP packed by count; PP2 (one packed length for every micro-batch) and DP2 (each
    replica its own number of micro-batches) by a token budget."""
    one = cli(tiny_qwen, add_prompts, hf_tok, *RUN, iters=4)
    argvs = [cli(tiny_qwen, add_prompts, hf_tok, *RUN, *f, iters=4) for f in LAYOUTS.values()]
    ref, out = one_and_layouts(one, argvs)
    for name, got in zip(LAYOUTS, out, strict=True):
        assert got["metrics"]["grpo/rewards/mean"] == ref["metrics"]["grpo/rewards/mean"], name
        _same(got, ref, ("actor/kl_loss", "actor/entropy"))


@pytest.mark.slow
def test_packed_moe_at_ep2_equals_one_padded_process(add_prompts, hf_tok, tiny_moe):
    """A Qwen3-MoE at EP2 packed by a token budget: every replica runs as many micro-batches
    of one packed length (the experts' exchanges match), and the run equals one padded
    process."""
    from anyspeed.convert import hf_cache as hf_load

    one = cli(tiny_moe, add_prompts, hf_tok, *RUN, "--init-kl-coef", "0", iters=2)
    ref = run_distributed(sft_ranks.posttrain, 1, argv=one, cli=one, timeout=300)[0]
    ep = one + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer", *DYNAMIC]
    flags = hf_load.expand(ep, tiny_moe)  # the adaptor sees the MoE architecture flags
    two = run_distributed(sft_ranks.posttrain, 2, argv=flags, cli=ep, timeout=300)[0]
    assert two["metrics"]["grpo/rewards/mean"] == ref["metrics"]["grpo/rewards/mean"]
    _same(two, ref)


def test_mindspeed_rl_config_keys(tmp_path):
    """MindSpeed-RL's rl_config keys stand in for the flags."""
    from anyspeed.stages.common.rl.flags import expand_config

    cfg = tmp_path / "rl.yaml"
    cfg.write_text("rl_config:\n  use_remove_padding: true\n  use_dynamic_bsz: true\n"
                   "  max_packing_token_size: 4096\n")  # fmt: skip
    got = expand_config(["--rl-config", str(cfg)])
    at = got.index("--max-packing-token-size")
    assert "--use-remove-padding" in got and "--use-dynamic-bsz" in got and got[at + 1] == "4096"
