"""Uneven pipeline stages: the layout's split, its one-line errors, and legacy conversion.

The split must be Megatron-Core's own (first/last stage as given, the middle stages equal), so it
is checked against ``get_transformer_layer_offset`` / ``get_num_layers_to_build`` being asked for
every stage; a legacy HF -> Megatron -> HF round trip with ``--num-layer-list`` is bit-identical.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from anyspeed.layout import Layout
from helpers.convert_ranks import hf_tensors, tiny_hf_model


@pytest.mark.parametrize(
    "pp,first,last,layers",
    [(2, 1, None, 3), (2, None, 1, 5), (3, 1, 1, 6), (4, 2, 3, 9), (4, None, 2, 8)],
)
def test_split_is_megatrons(pp, first, last, layers):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    ours = Layout(pp=pp, first_stage_layers=first, last_stage_layers=last).stage_layers(layers)
    cfg = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=1,
                            pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                            num_layers_in_first_pipeline_stage=first,
                            num_layers_in_last_pipeline_stage=last)  # fmt: skip
    counts, offsets = [], []
    for stage in range(pp):
        counts.append(get_num_layers_to_build(cfg, pp_rank=stage))
        offsets.append(get_transformer_layer_offset(cfg, pp_rank=stage))
    assert ours == counts
    assert offsets == [sum(counts[:s]) for s in range(pp)]


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(num_layer_list="1,1,1"), "one entry per pipeline stage"),
        (dict(num_layer_list="2,1,3,2", pipeline_model_parallel_size=4), "middle stages"),
        (dict(num_layer_list="1,x"), "one whole number per stage"),
        (dict(decoder_first_pipeline_num_layers=3), "cannot split --num-layers 3"),
    ],
)
def test_bad_stage_flags_are_one_line(flags, message):
    args = argparse.Namespace(**{"pipeline_model_parallel_size": 2, "num_layers": 3, **flags})
    with pytest.raises(ValueError, match=message):
        Layout.from_args(args).validate(2, num_layers=3)


def test_legacy_round_trip_with_num_layer_list(tmp_path):
    from anyspeed.convert import ConvertError, hf_to_megatron, megatron_to_hf

    tiny_hf_model(tmp_path / "hf", "tiny-qwen2.5", seed=1, num_hidden_layers=3)
    hf_to_megatron(tmp_path / "hf", tmp_path / "mg", pp=2, ckpt_format="legacy",
                   num_layer_list="1,2")  # fmt: skip
    stage1 = torch.load(tmp_path / "mg/iter_0000001/mp_rank_00_001/model_optim_rng.pt")
    assert {k.split(".")[2] for k in stage1["model"] if k.startswith("decoder.layers.")} == {
        "0",
        "1",
    }
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", tmp_path / "hf")
    a, b = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConvertError, match="does not add up"):
        hf_to_megatron(tmp_path / "hf", tmp_path / "bad", pp=2, ckpt_format="legacy",
                       num_layer_list="2,2")  # fmt: skip
