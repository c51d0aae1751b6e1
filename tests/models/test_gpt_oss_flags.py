"""GPT-OSS's flags before anything starts: the preset gives the family's traits, and what this
build cannot honour (sinks or windows at CP > 1, a window that looks ahead, two activations) is
one line naming the flag."""

from __future__ import annotations

import argparse

import pytest
from test_moe_flags import check_args

from anyspeed.errors import UsageError
from anyspeed.models.arch_flags import window_type
from anyspeed.stages.arguments import parse_pretrain_args

RUN = ("--model tiny-gpt-oss --mock-data --vocab-size 512 --seq-length 64 --train-iters 2 "
       "--lr 1e-3 --global-batch-size 8 --micro-batch-size 2").split()  # fmt: skip


def test_the_preset_carries_the_family_traits():
    model = check_args(parse_pretrain_args(RUN), 1).model
    assert (model.softmax_type, model.window_size, model.quick_geglu) == ("learnable", 3, True)
    assert (model.glu_linear_offset, model.activation_func_clamp_value) == (1.0, 7.0)
    assert model.add_bias_linear and model.position_embedding_type == "yarn"
    assert model.window_layers() == [True, False]  # sliding first, then full (HF's order)
    # the flags the preset expands to read back as the same model, of the same family
    again = check_args(parse_pretrain_args([*model.megatron_args(), *RUN[2:]]), 1).model
    assert again.same_architecture(model) == ["name"] and again.family == "gpt_oss"


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--context-parallel-size", "2"], "--context-parallel-size 2"),
        (["--tensor-model-parallel-size", "2"], "--expert-tensor-parallel-size 1"),
        (["--softmax-type", "vanilla", "--context-parallel-size", "2"], "--window-size"),
        (["--swiglu"], "--quick-geglu"),
        (["--window-attn-skip-freq", "[1]*3"], "--num-layers"),
    ],
)
def test_what_cannot_run_is_one_line_before_start(flags, words):
    with pytest.raises(UsageError) as err:
        check_args(parse_pretrain_args([*RUN, *flags]), 2)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_window_size_reads_megatron_pairs_and_refuses_lookahead():
    assert window_type("(127,0)") == window_type("127, 0") == window_type("127") == 127
    with pytest.raises(argparse.ArgumentTypeError, match="causal"):
        window_type("(3,2)")
