"""Uneven pipeline stages: the layout's split, its one-line errors, and legacy conversion.

First and last stages as given, the middle ones equal, is Megatron-Core's own split, checked
against ``get_transformer_layer_offset`` / ``get_num_layers_to_build`` being asked for every
stage. A ``--num-layer-list`` whose middle stages differ (a third of MindSpeed-LLM's recipes:
``17,20,22,21``) is anyspeed's placement: checked against the list itself, against those
functions as the adaptor's ``chunk-placement`` patch answers them, as Megatron-LM's pipeline
layout, and in training at PP 4 against one process (``-m slow``). Legacy HF -> Megatron -> HF
round trips with ``--num-layer-list`` are bit-identical.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from anyspeed.layout import Layout
from anyspeed.testing import run_distributed
from helpers import trainer_ranks
from helpers.convert_ranks import legacy_round_trip


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
        (dict(num_layer_list="2,1,3,2", pipeline_model_parallel_size=4), "adding up to"),
        (dict(num_layer_list="0,1,1,1", pipeline_model_parallel_size=4), "at least one layer"),
        (dict(num_layer_list="1,x"), "one whole number per stage"),
        (dict(decoder_first_pipeline_num_layers=3), "cannot split --num-layers 3"),
    ],
)
def test_bad_stage_flags_are_one_line(flags, message):
    args = argparse.Namespace(**{"pipeline_model_parallel_size": 2, "num_layers": 3, **flags})
    with pytest.raises(ValueError, match=message):
        Layout.from_args(args).validate(args.pipeline_model_parallel_size, num_layers=3)


def test_legacy_round_trip_with_num_layer_list(tmp_path):
    from anyspeed.convert import ConvertError, hf_to_megatron

    legacy_round_trip(tmp_path, 3, 2, [1, 2], num_layer_list="1,2")
    with pytest.raises(ConvertError, match="does not add up"):
        hf_to_megatron(tmp_path / "hf", tmp_path / "bad", pp=2, ckpt_format="legacy",
                       num_layer_list="2,2")  # fmt: skip


LISTS = [(4, "17,20,22,21"), (8, "7,7,7,8,8,8,8,8"), (8, "10,12,8,8,8,12,12,8"), (4, "1,2,1,1")]


@pytest.mark.parametrize("pp,text", LISTS)
def test_a_list_of_unequal_middle_stages_is_placed_as_listed(pp, text):
    """MindSpeed-LLM's recipes' lists: each stage holds the next ``count`` layers, and the
    adaptor's chunk-placement answers Megatron's offset and layer-count questions so."""
    from anyspeed import adaptor
    from anyspeed.models import ModelConfig
    from anyspeed.models.gpt import transformer_config

    counts = [int(x) for x in text.split(",")]
    args = argparse.Namespace(pipeline_model_parallel_size=pp, num_layers=sum(counts),
                              num_layer_list=text)  # fmt: skip
    lay = Layout.from_args(args)
    lay.validate(pp, num_layers=sum(counts))
    starts = [sum(counts[:k]) for k in range(pp)]
    assert [lay.chunk_layers(sum(counts), r) for r in range(pp)] == [
        [range(a, a + n)] for a, n in zip(starts, counts, strict=True)
    ]
    adaptor.apply(argv=[])
    try:
        from megatron.core.transformer import transformer_block, transformer_layer

        cfg = transformer_config(ModelConfig(num_layers=sum(counts), hidden_size=8,
                                             num_attention_heads=1), lay)  # fmt: skip
        for rank in range(pp):
            got = (transformer_layer.get_transformer_layer_offset(cfg, None, rank),
                   transformer_block.get_num_layers_to_build(cfg, None, rank))  # fmt: skip
            assert got == (starts[rank], counts[rank])
    finally:
        adaptor.undo()


def test_the_feature_keeps_a_placed_list_and_megatron_lm_gets_a_layout():
    """An equal-middle list becomes Megatron's first/last flags; an unequal one stays for the
    layout, and Megatron-LM's loop gets it as its --pipeline-model-parallel-layout (the
    embedding first, the loss last); with VPP it is one line."""
    from anyspeed.device import detect
    from anyspeed.features import registry
    from anyspeed.features.base import FeatureError
    from anyspeed.features.compat.megatron_lm_steps import placement_layout_args

    feature = registry.get("num-layer-list")
    even = argparse.Namespace(
        pipeline_model_parallel_size=4, num_layers=8, num_layer_list="1,3,3,1"
    )
    feature.validate(even, detect())
    assert (even.decoder_first_pipeline_num_layers, even.decoder_last_pipeline_num_layers,
            even.num_layer_list) == (1, 1, None)  # fmt: skip
    listed = argparse.Namespace(pipeline_model_parallel_size=4, num_layers=5,
                                num_layer_list="1,2,1,1", mtp_num_layers=None)  # fmt: skip
    feature.validate(listed, detect())
    assert listed.num_layer_list == "1,2,1,1"
    placement_layout_args(listed)
    assert listed.pipeline_model_parallel_layout == "Et|tt|t|tL"
    assert listed.num_layer_list is None
    vpp = argparse.Namespace(pipeline_model_parallel_size=4, num_layers=5,
                             num_layer_list="1,2,1,1",
                             num_layers_per_virtual_pipeline_stage=1)  # fmt: skip
    with pytest.raises(FeatureError, match="drop --num-layers-per-virtual-pipeline-stage"):
        feature.validate(vpp, detect())


def test_legacy_round_trip_with_unequal_middle_stages(tmp_path):
    """HF -> legacy Megatron at PP 4 with --num-layer-list 1,2,1,1 -> HF, bit for bit."""
    legacy_round_trip(tmp_path, 5, 4, [1, 2, 1, 1], num_layer_list="1,2,1,1")


@pytest.mark.slow  # 4 processes
def test_pp4_with_unequal_middle_stages_matches_one_process(tmp_path):
    """5 layers as 1, 2, 1, 1 at PP 4 against one process from the same weights: 3 steps' loss
    and grad norm and the eval loss within 1e-5, and the logits of the saved checkpoint."""
    init, tokens, ref = trainer_ranks.one_process_reference(tmp_path, 5)
    got = run_distributed(trainer_ranks.train_eval_save_logits, 4,
                          layout=dict(pp=4, layer_list=(1, 2, 1, 1)), load=init,
                          save=str(tmp_path / "listed"), tokens=tokens, spec=dict(num_layers=5),
                          timeout=600)  # fmt: skip
    for rank in got:
        for r, g in zip(ref["steps"], rank["steps"], strict=True):
            assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
            assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
        assert rank["eval"] == pytest.approx(ref["eval"], rel=1e-5)
    torch.testing.assert_close(got[3]["logits"], ref["logits"], rtol=0, atol=3e-5)
