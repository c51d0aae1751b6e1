"""The lean one-token decode step (``no-grad-fast-path``) against Megatron's own forward:
for each layer kind it supports (MLA and MoE blocks called as modules) the logits of every decode
step match within 1e-5 (fp32) at TP1, TP2 and PP2, with the same greedy tokens; a model it does not
support (learned absolute positions) runs Megatron's forward.
Stop strings of the decode loop and the evaluation likelihood scorer are checked here too (they
need a model to run)."""

from __future__ import annotations

import pytest
import torch

from anyspeed.testing import run_distributed
from helpers import decode_ranks

STEPS = 6


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    two = [(2, 1), (1, 2)]
    return run_distributed(
        decode_ranks.lean_vs_megatron, 2, layouts=two, steps=STEPS, timeout=300
    ) + [  # fmt: skip
        run_distributed(
            decode_ranks.lean_vs_megatron, 1, layouts=[(1, 1)], steps=STEPS, timeout=300
        )[0]  # fmt: skip
    ]


@pytest.mark.parametrize("case", sorted(decode_ranks.CASES))
def test_lean_step_equals_megatron_forward(ranks: list[dict], case: str) -> None:
    seen = 0
    for rank in ranks:
        for key, value in rank.items():
            if not isinstance(key, tuple) or key[1] != case:
                continue
            layout, (lean, megatron, lean_calls, order) = key[0], value
            seen += 1
            if case == "learned-positions":
                assert lean_calls == 0  # not supported: Megatron's forward ran every step
            else:  # every decode step (not the prefill) of every layer of the stage ran lean
                layers = 1 if layout == "tp1pp2" else 2
                # (LongRoPE: the step past the pretraining length encodes the whole sequence
                # again through Megatron's forward, as transformers does)
                steps = STEPS - 2 if case == "longrope" else STEPS - 1
                assert lean_calls == steps * layers, (case, layout)
            # the lean step's cache holds each row's slots together (MLA keeps its own cache;
            # Megatron's forward, the reference, allocates its own order)
            step_order = case not in ("learned-positions", "mla")
            assert order == [step_order, False], (case, layout)
            for step, (a, b) in enumerate(zip(lean, megatron, strict=True)):
                assert (a is None) == (b is None)
                if a is not None:  # bf16: within a few bf16 steps of the logits' size
                    msg = f"{case} {layout} step {step}"
                    atol = 3e-2 if case == "bf16" else 1e-5
                    torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=msg)
                    if case != "bf16":  # both runs are fed the lean run's tokens
                        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert seen == 5  # TP2 and PP2 on two ranks, TP1


@pytest.mark.parametrize("case", sorted(set(decode_ranks.CASES) - {"longrope"}))
def test_ended_rows_leave_the_batch(ranks: list[dict], case: str) -> None:
    """Rows that end at different steps leave the batch and its KV cache (at a quarter of the
    rows ended): every row's tokens equal the row decoded alone, greedily and sampled with a
    generator per row, and its log-probs within 1e-5 (bf16: 3e-2), at TP1, TP2 and PP2.
    (Not LongRoPE: its factor set follows the batch's longest sequence, as transformers picks
    by the batch's largest position, so a row alone may rotate by the other set.)"""
    seen = 0
    for rank in ranks:
        for key, value in rank.items():
            if not (isinstance(key, tuple) and key[0] == "compact" and key[2] == case):
                continue
            seen += 1
            for mode, ((tokens, lps), alone, sizes) in value.items():
                msg = f"{case} {key[1]} {mode}"
                assert sizes and sizes[0] < 5 and sizes == sorted(sizes, reverse=True), msg
                assert len({len(t) for t in tokens}) > 1, msg  # the rows ended apart
                for row, (want, want_lp), lp in zip(tokens, alone, lps, strict=True):
                    assert row == want, msg
                    tol = 3e-2 if case == "bf16" else 1e-5
                    torch.testing.assert_close(torch.tensor(lp), torch.tensor(want_lp),
                                               rtol=0, atol=tol, msg=msg)  # fmt: skip
    assert seen == 5


def test_stop_strings_end_each_row_where_its_text_first_holds_one(ranks: list[dict]) -> None:
    """Against the run without a stop string: each row ends at the first token whose text
    contains the stop string (leading whitespace dropped), the other rows run on."""
    free, stop, got = ranks[-1]["stop"]
    for row, tokens in zip(free, got, strict=True):
        n = next((n for n in range(1, len(row) + 1)
                  if stop in decode_ranks.detokenize(row[:n]).lstrip()), len(row))  # fmt: skip
        assert tokens == row[:n]
    assert len(got[0]) <= 6 < len(free[0])


def test_continuation_likelihoods_batched_equal_one_pair_at_a_time(ranks: list[dict]) -> None:
    """``anyspeed evaluate``'s likelihood scorer (left-padded batches, TP1 and TP2) against
    plain log-softmax of each pair's own unpadded forward."""
    for rank in ranks:
        got, ref = rank["likelihood"]
        assert [n for _, n in got] == [2, 1, 3, 2]
        for (total, _), want in zip(got, ref, strict=True):
            assert abs(total - want) < 1e-4, (total, want)


def test_beam_search_with_sampling_is_seeded(ranks: list[dict]) -> None:
    """The same seed draws the same beams; another seed, and plain beam search, differ."""
    for rank in ranks:
        beams, sampled, again, other = rank["beams"]
        assert len(sampled) == 10 and sampled == again
        assert sampled != beams and other != sampled


@pytest.mark.parametrize("tp", [1, 2])
def test_weights_in_transposed_order_give_the_same_logits(tp: int) -> None:
    """``transpose_for_decode`` (a CPU inference load) moves every linear weight of a plain
    fp32 model, the tied embedding too, and none of a bf16, MoE or MLA model; the decode
    steps' logits stay within 1e-5 of Megatron's weight order, with the same greedy tokens."""
    ranks = run_distributed(decode_ranks.transposed_vs_plain, tp, tp=tp, steps=4, timeout=300)
    for rank in ranks:
        # 2 layers x (QKV, projection, FC1, FC2) + the output layer (or the tied embedding)
        assert {k: v[0] for k, v in rank.items()} == {
            "gqa-swiglu": 9, "qkv-bias-tied": 9, "bf16": 0, "moe": 0, "mla": 0,
        }  # fmt: skip
        for name, (_, moved, plain) in rank.items():
            for a, b in zip(moved, plain, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
                assert torch.equal(a.argmax(-1), b.argmax(-1)), name


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_weights_give_the_same_logits(tp: int) -> None:
    """``prepare_for_decode`` (a CPU inference load) packs the products of plain fp32 models
    (where MKL has packed products) and transposes nothing else there; each decode step's
    logits stay within 1e-5 of the lean step's plain products, with the same greedy tokens, and
    a weight changed in place or given new data since it was packed is packed again; a
    rollout of a model being trained packs for its duration only."""
    from anyspeed.features.inference import packed

    mkl = packed.available()
    ranks = run_distributed(decode_ranks.packed_vs_plain, tp, tp=tp, steps=4, timeout=300)
    for rank in ranks:
        plain_kind = "packed" if mkl else "transposed"
        assert {k: v[0] for k, v in rank.items()} == {
            "gqa-swiglu": plain_kind, "qkv-bias-tied": plain_kind,
            "layernorm-gelu-bias": plain_kind, "bf16": "", "moe": "",
        }  # fmt: skip
        for name, (_, got, plain, changed, changed_plain, had, rollout) in rank.items():
            assert had == (name in ("gqa-swiglu", "qkv-bias-tied", "layernorm-gelu-bias") and mkl)
            # a rollout of a model being trained: packed only while it runs
            assert rollout[0] == had and rollout[2], name
            for a, b in zip(rollout[1], plain, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
            for a, b in zip(got + changed, plain + changed_plain, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
                assert torch.equal(a.argmax(-1), b.argmax(-1)), name
            # the updates changed the logits (so a stale packed copy would show)
            assert (changed[-1] - got[-1]).abs().max() > 1e-3, name


def test_only_hooks_it_replays_keep_the_step() -> None:
    """The step computes the logits from the output layer's weight: Gemma's logit soft-cap (a
    hook on that layer it replays) and the embedding scale (a hook it calls through the module)
    keep it; a hook it does not know on a module it bypasses sends decoding through Megatron's
    forward."""
    got = run_distributed(decode_ranks.plans_with_hooks, 1, timeout=300)[0]
    assert got == {"plain": True, "capped-logits": True, "scaled-embeddings": True,
                   "user-hook-on-head": False, "user-hook-on-qkv": False}  # fmt: skip


def test_megatrons_windowed_softmax_keeps_the_padding_hidden() -> None:
    """Megatron's own sliding-window softmax replaced the padding mask by its window mask
    (feature ``window-padding-mask`` adds them): the padded prompt of a batch got other greedy
    tokens than alone before, the same now."""
    got = run_distributed(decode_ranks.windowed_rows_through_megatron, 1, timeout=300)[0]
    assert got == {"same": [True, True]}
