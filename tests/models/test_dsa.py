"""DeepSeek-V3.2's sparse attention pieces against independent references: the indexer's KL
loss equals Megatron-Core's own ``compute_dsa_indexer_loss`` (dense and sparse), and settings
that cannot build are one line naming the flag. (The indexer against transformers: the
conversion, training and generation tests of ``tiny-deepseek-v3.2``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from anyspeed.models import get_preset
from anyspeed.models.dsa import indexer_kl


@pytest.mark.parametrize("sparse", [False, True])
def test_indexer_kl_equals_megatrons(sparse):
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        compute_dsa_indexer_loss,
    )

    g = torch.Generator().manual_seed(3)
    b, s, n, d, topk = 2, 12, 4, 8, 5
    query, key = torch.randn(s, b, n, d, generator=g), torch.randn(s, b, n, d, generator=g)
    scores = torch.randn(b, s, s, generator=g)
    hidden = torch.ones(s, s, dtype=torch.bool).triu(1)
    masked = scores.masked_fill(hidden, torch.finfo(torch.float32).min)
    top = masked.topk(topk, dim=-1).indices
    got = indexer_kl(masked, top, query, key, 0.3, sparse)
    pg = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))  # one TP rank
    ref = scores.masked_fill(hidden, float("-inf"))
    want = compute_dsa_indexer_loss(ref, top, query, key, 0.3, 1.0, sparse, pg)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert float(got) > 0.1  # not a trivially equal zero


def test_indexer_loss_joins_the_backward_at_the_main_losss_scale():
    """The attention's output passes unchanged; the loss's gradient is ``scale`` (the main
    loss's 1 / micro-batches), so the indexer descends its own KL."""
    from anyspeed.models.dsa import IndexerLoss

    w = torch.randn(5, requires_grad=True)
    out = torch.randn(3, requires_grad=True)
    IndexerLoss.scale = 0.25
    try:
        y = IndexerLoss.apply(out, (w**2).sum())
        assert torch.equal(y, out)
        (2 * y.sum()).backward()
    finally:
        IndexerLoss.scale = 1.0
    assert torch.equal(out.grad, torch.full((3,), 2.0))
    assert torch.allclose(w.grad, 0.25 * 2 * w.detach())


@pytest.mark.parametrize(
    "changes, flag",
    [
        (dict(multi_latent_attention=False), "--multi-latent-attention"),
        (dict(dsa_indexer_topk=None), "--dsa-indexer-topk"),
        (dict(dsa_indexer_head_dim=4), "--dsa-indexer-head-dim"),
    ],
)
def test_settings_that_cannot_build_are_one_line(changes, flag):
    with pytest.raises(ValueError, match=flag) as err:
        get_preset("tiny-deepseek-v3.2").replace(**changes).check()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--recompute-granularity", "selective"], "--recompute-modules core_attn"),
        (["--context-parallel-size", "2"], "--context-parallel-size"),
    ],
)
def test_layouts_it_cannot_run_are_one_line_before_start(flags, words):
    from test_moe_flags import check_args

    from anyspeed.errors import UsageError
    from anyspeed.stages.arguments import parse_pretrain_args

    run = (
        "--model tiny-deepseek-v3.2 --mock-data --vocab-size 512 --seq-length 64 "
        "--train-iters 2 --lr 1e-3 --global-batch-size 8 --micro-batch-size 2"
    ).split()
    with pytest.raises(UsageError) as err:  # fmt: skip
        check_args(parse_pretrain_args([*run, *flags]), 2)
    assert words in str(err.value) and "\n" not in str(err.value)
