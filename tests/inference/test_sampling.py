"""Token choice against plain references: the top-p set equals the one a full sort gives
(narrow nuclei found among the top k, wide ones by a sort), drawn tokens follow their
probabilities and never land on a token of probability 0, and a row with its own generator
draws the same token whatever rows share its batch."""

from __future__ import annotations

import pytest
import torch

from anyspeed.inference.sampling import SamplingParams, draw, next_tokens, nucleus, uniforms


def _sorted_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference: every token whose more likely tokens hold under ``top_p`` of the mass."""
    probs = logits.softmax(-1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    for r in range(len(probs)):
        order = sorted(range(probs.shape[1]), key=lambda i: -float(probs[r, i]))
        above = 0.0
        for i in order:
            if above >= top_p:
                break
            keep[r, i] = True
            above += float(probs[r, i])
    return keep


@pytest.mark.parametrize("scale", [0.1, 2.0, 8.0])  # flat (wide nucleus) to peaked (narrow)
@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_nucleus_equals_a_full_sort(scale: float, top_p: float) -> None:
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(7)) * scale
    got = nucleus(logits, top_p)
    ref = _sorted_nucleus(logits, top_p)
    # the reference sums in double: a token at the edge may differ by rounding, none other
    assert (got != ref).sum() <= 1, (got.sum(-1), ref.sum(-1))
    assert got.any(-1).all()  # the most likely token always stays


def test_nucleus_within_top_k() -> None:
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(greedy=False, top_k=20, top_p=0.8)
    from anyspeed.inference.sampling import filter_logits

    kept = filter_logits(logits, params).isfinite()
    cut = logits.masked_fill(logits < logits.topk(20).values[:, -1:], float("-inf"))
    assert torch.equal(kept, _sorted_nucleus(cut, 0.8))
    assert (kept.sum(-1) <= 20).all()


def test_draws_follow_the_probabilities() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.1, 0.0, 0.0, 0.0, 0.0, 0.9]])
    n = 40_000
    g = torch.Generator().manual_seed(0)
    got = torch.stack([draw(probs, uniforms(2, g)) for _ in range(n)])  # [n, 2]
    for r in range(2):
        freq = torch.bincount(got[:, r], minlength=6).double() / n
        sigma = (probs[r].double() * (1 - probs[r].double()) / n).sqrt()
        assert ((freq - probs[r].double()).abs() <= 5 * sigma + 1e-12).all(), freq
        assert (freq[probs[r] == 0] == 0).all()


@pytest.mark.parametrize("n", [5000, 4096, 700])  # several blocks with a ragged tail, whole, one
def test_draw_by_blocks_equals_a_flat_inversion(n: int) -> None:
    """Over many rows the blocked inversion picks the token a flat float64 cumulative sum
    picks, and never one of probability 0."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(200, n, generator=g) * 2
    logits[torch.rand(200, n, generator=g) < 0.5] = float("-inf")  # half the tokens: p = 0
    probs = logits.softmax(-1)
    u = torch.rand(200, 1, generator=g, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    ref = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    got = draw(probs, u, block=1024)
    assert torch.equal(got, ref)
    assert (probs.gather(1, got[:, None]) > 0).all()


@pytest.mark.parametrize("top_k", [0, 4])
def test_sampled_tokens_follow_the_filtered_distribution(top_k: int) -> None:
    """``next_tokens`` with temperature, top-k and top-p against the distribution written out:
    softmax of the scaled logits, cut to top-k, cut to the nucleus, renormalised."""
    logits = torch.tensor([[2.0, 0.5, 1.5, -1.0, 1.0, 0.0, 3.0, -2.0]])
    params = SamplingParams(greedy=False, temperature=0.8, top_k=top_k, top_p=0.8)
    scaled = logits / 0.8
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[:, -1:], float("-inf"))
    probs = scaled.softmax(-1) * _sorted_nucleus(scaled, 0.8)
    probs = (probs / probs.sum()).double()[0]
    n, g = 10_000, torch.Generator().manual_seed(2)
    got = torch.stack([next_tokens(logits, params, g) for _ in range(n)])[:, 0]
    freq = torch.bincount(got, minlength=8).double() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-12).all(), (freq, probs)
    assert (freq[probs == 0] == 0).all() and (probs > 0).sum() >= 2


def test_draw_at_the_ends_of_the_unit_interval() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.75, 0.0]])
    low, high = torch.tensor([[0.0]], dtype=torch.float64), torch.tensor([[1 - 2**-53]])
    assert draw(probs, low).tolist() == [1] and draw(probs, high.double()).tolist() == [2]
    spread = torch.zeros(1, 3000)
    spread[0, [5, 1500, 2100]] = torch.tensor([0.2, 0.3, 0.5])  # three blocks of 1024
    assert draw(spread, low).tolist() == [5] and draw(spread, high.double()).tolist() == [2100]


def test_a_row_with_its_own_generator_ignores_its_neighbours() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(greedy=False, temperature=0.9, top_p=0.95)

    def gens(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    batch = next_tokens(logits, params, row_generators=gens(range(10, 15)))
    alone = [int(next_tokens(logits[i : i + 1], params, row_generators=gens([10 + i]))[0])
             for i in range(5)]  # fmt: skip
    assert batch.tolist() == alone
    with pytest.raises(ValueError, match="3 row generators for 5 rows"):
        next_tokens(logits, params, row_generators=gens(range(3)))
