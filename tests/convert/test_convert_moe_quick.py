"""A quick MoE conversion check for CI (the full one, with logits at EP1/EP2 and the 8-process
layout, is tests/convert/test_convert_moe.py under ``-m slow``): a tiny DeepSeek-V2-Lite model
(MLA, dense first layer, shared experts, 3 layers) to the legacy layout split over TP2 x PP2 x EP2
(``--num-layer-list 1,2``) and back, bit-identical, with each EP rank holding half the experts."""

from __future__ import annotations

import torch
from test_convert import _load_hf_tensors

from anyspeed.convert import hf_to_megatron, megatron_to_hf
from helpers import convert_ranks


def test_deepseek_legacy_ep2_round_trip(tmp_path):
    convert_ranks.tiny_hf_model(tmp_path / "hf", "tiny-deepseek-v2-lite", seed=3)
    hf_to_megatron(tmp_path / "hf", tmp_path / "mg", tp=2, pp=2, ep=2, ckpt_format="legacy",
                   num_layer_list="1,2")  # fmt: skip
    rank = torch.load(tmp_path / "mg/iter_0000001/mp_rank_01_001_001/model_optim_rng.pt")
    experts = {k.split("local_experts.")[1].split(".")[0] for k in rank["model"]
               if "local_experts" in k}  # fmt: skip
    assert experts == {"0", "1", "2", "3"}  # 8 experts over 2 EP ranks, numbered locally
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", tmp_path / "hf")
    ref, got = _load_hf_tensors(tmp_path / "hf"), _load_hf_tensors(tmp_path / "back")
    assert ref.keys() == got.keys() and any(".experts.7." in k for k in ref)
    assert all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in ref.items())
