"""Qwen3.5's text models (``Qwen3_5ForCausalLM``: Qwen3-Next's hybrid of gated DeltaNets and
output-gated attention with a dense MLP, the DeltaNet's input projections kept apart; and
``Qwen3_5MoeForCausalLM``, its MLPs Qwen3-Next's experts with a gated shared expert) against
transformers: a tiny random model's logits after conversion within 1e-4 (fp32; at TP2 with
``-m slow``), the conversion back bit-identical, and KV-cache greedy tokens (the DeltaNet's
recurrent state) equal to transformers' ``generate`` (``-m slow``)."""

from __future__ import annotations

import pytest
import torch
from test_convert import _check

from anyspeed.convert.verify import hf_logits
from anyspeed.testing import run_distributed
from helpers import convert_ranks
from helpers.family_convert import assert_round_trip, converted

TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(17))


@pytest.fixture(scope="module", params=["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def q35(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    case, res = converted(root, request.param, TOKENS, seed=9)
    return root, case, res, request.param


def test_logits_equal_transformers_and_convert_back(q35):
    root, case, res, _ = q35
    _check(hf_logits(root / "hf", TOKENS), res["dist"])
    assert "model.layers.0.linear_attn.in_proj_z.weight" in assert_round_trip(case)


@pytest.mark.slow  # a two-process group
def test_logits_equal_transformers_at_tp2(q35):
    root, case, _, _ = q35
    ranks = run_distributed(convert_ranks.layout_logits, 2, cases={"q35": case}, tp=2, pp=1,
                            tokens=TOKENS, timeout=300)  # fmt: skip
    for rank in ranks:
        _check(hf_logits(root / "hf", TOKENS), rank["q35"]["dist"])


@pytest.mark.slow  # a two-process group
def test_moe_logits_equal_transformers_at_ep2(q35):
    root, case, _, preset = q35
    if not preset.endswith("moe"):
        pytest.skip("the dense model has no experts")
    ranks = run_distributed(convert_ranks.layout_logits, 2, cases={"q35": case}, tp=1, pp=1,
                            ep=2, tokens=TOKENS, timeout=300)  # fmt: skip
    for rank in ranks:
        _check(hf_logits(root / "hf", TOKENS), rank["q35"]["dist"])
