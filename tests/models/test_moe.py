"""MoE layers built by anyspeed vs. independent references (fp32, max-abs tolerances).

* One MoE layer equals transformers' ``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock`` on
  the same weights: outputs and input gradients within 1e-6, with sequential and grouped experts.
* Token dropping with a capacity factor equals plain torch that keeps each expert's most
  probable routed tokens.
* The grouped matmul equals a per-expert loop, forward and backward, with an empty expert and
  with row sizes torch's kernel refuses (not 16-byte aligned).
"""

from __future__ import annotations

import pytest
import torch

from anyspeed.features.moe.grouped_gemm import grouped_matmul, kernel_accepts
from anyspeed.models.config import ModelConfig
from anyspeed.models.patterns import layer_pattern as moe_layer_pattern
from anyspeed.testing import run_distributed
from helpers import moe_ranks


@pytest.fixture(scope="module")
def layer_results():
    return run_distributed(moe_ranks.moe_layer_vs_hf_all, 1, timeout=180)[0]


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_layer_matches_transformers(layer_results, family, grouped):
    res = layer_results[(family, grouped)]
    assert res["experts"] == ("GroupedMLP" if grouped else "SequentialMLP")
    assert res["out"] <= 1e-6 and res["grad"] <= 1e-6, res


def test_capacity_factor_drops_the_least_likely_tokens(layer_results):
    res = layer_results["capacity"]
    assert res["kept"] < res["routed"]  # the factor 0.5 dropped tokens
    assert res["diff"] <= 1e-6, res


def test_expert_bias_routing_matches_plain_torch(layer_results):
    """Training with sigmoid scores and expert bias runs off CUDA (its bias bookkeeping is
    torch.compile'd in Megatron-Core) and routes as the reference does."""
    res = layer_results["expert_bias"]
    assert res["eager"]  # inductor off CUDA fails in torchrun ranks (CUDA device properties)
    assert res["bias_moved_choice"]  # the planted bias changes which experts are chosen
    assert res["counts"] == res["want"]
    assert res["diff"] <= 1e-6, res


@pytest.mark.parametrize(
    "k,n,counts",
    [(16, 24, [5, 0, 9, 2]), (12, 6, [3, 4, 0, 7]), (16, 8, [0, 0, 0, 0])],
    ids=["aligned-empty-expert", "misaligned", "no-tokens"],
)
def test_grouped_matmul_matches_loop(k, n, counts):
    g = torch.Generator().manual_seed(0)
    t = sum(counts)
    x = torch.randn(t, k, generator=g, requires_grad=True)
    w = torch.randn(len(counts), k, n, generator=g, requires_grad=True)
    grad = torch.randn(t, n, generator=g)
    out = grouped_matmul(x, w, torch.tensor(counts))
    out.backward(grad)
    gx, gw = x.grad, w.grad
    assert gw is not None and gw.shape == w.shape  # every expert gets a gradient, even unused
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([p @ wr[i] for i, p in enumerate(torch.split(xr, counts))] or [xr @ wr[0]])
    ref.backward(grad)
    close = dict(atol=1e-6, rtol=0)
    torch.testing.assert_close(out, ref, **close)
    torch.testing.assert_close(gx, xr.grad, **close)
    torch.testing.assert_close(gw, wr.grad, **close)
    if (k, n) == (12, 6):
        assert not kernel_accepts(x, w)  # the loop fallback ran


def test_grouped_matmul_bf16_close_to_fp32():
    g = torch.Generator().manual_seed(0)
    x, w, counts = torch.randn(30, 16, generator=g), torch.randn(3, 16, 8, generator=g), [10, 0, 20]
    out = grouped_matmul(x.bfloat16(), w.bfloat16(), torch.tensor(counts)).float()
    ref = grouped_matmul(x, w, torch.tensor(counts))
    assert out.dtype == torch.float32 and (out - ref).abs().max().item() <= 0.1


def test_moe_layer_pattern_and_parameter_count():
    assert moe_layer_pattern("2", 4) == [1, 0, 1, 0]
    assert moe_layer_pattern("([0]*1+[1]*3)", 4) == [0, 1, 1, 1]
    for bad in ("[2]*4", "[0]*3", "eval('1')", "0"):
        with pytest.raises(ValueError, match="--moe-layer-freq"):
            moe_layer_pattern(bad, 4)
    dense = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, vocab_size=64)
    moe = dense.replace(num_experts=4, moe_layer_freq="[0]*1+[1]*1")
    extra = 4 * 3 * 32 * 48 + 4 * 32 - 3 * 32 * 48  # 4 experts + router replace one dense MLP
    assert moe.num_parameters() - dense.num_parameters() == extra
