"""Qwen3-Next's flags before anything starts: the preset gives the family's traits (and reads
back from the flags it expands to), and what this build cannot honour (DeltaNet layers at
CP > 1, a layer pattern that does not fit, value heads that do not group over key heads) is
one line naming the flag."""

from __future__ import annotations

import pytest
from test_moe_flags import check_args

from anyspeed.errors import UsageError
from anyspeed.stages.arguments import parse_pretrain_args

RUN = ("--model tiny-qwen3-next --mock-data --vocab-size 512 --seq-length 64 --train-iters 2 "
       "--lr 1e-3 --global-batch-size 8 --micro-batch-size 2").split()  # fmt: skip


def test_the_preset_carries_the_family_traits():
    model = check_args(parse_pretrain_args(RUN), 1).model
    assert model.linear_attention_layers() == [True, True, True, False]
    assert model.attention_output_gate and model.layernorm_zero_centered_gamma
    assert (model.rotary_percent, model.moe_shared_expert_gate) == (0.25, True)
    again = check_args(parse_pretrain_args([*model.megatron_args(), *RUN[2:]]), 1).model
    assert again.same_architecture(model) == ["name"] and again.family == "qwen3_next"


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--context-parallel-size", "2"], "--context-parallel-size 2"),
        (["--linear-attention-freq", "[1]*3"], "--linear-attention-freq"),
        (["--linear-num-value-heads", "3"], "--linear-num-value-heads"),
        (
            [
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--linear-num-key-heads",
                "1",
                "--linear-num-value-heads",
                "2",
            ],
            "divisible by --tensor-model-parallel-size 2",
        ),
    ],
)
def test_what_cannot_run_is_one_line_before_start(flags, words):
    with pytest.raises(UsageError) as err:
        check_args(parse_pretrain_args([*RUN, *flags]), 2)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_family_without_deltanet_layers_cannot_describe_them():
    """A LLaMA-family model given DeltaNet layers trains, but converts to no HF class."""
    from anyspeed.models import get_preset
    from anyspeed.models.hf import hf_config

    model = get_preset("tiny-llama3").replace(
        experimental_attention_variant="gated_delta_net", linear_attention_freq="2"
    )
    with pytest.raises(ValueError, match="no gated DeltaNet layers"):
        hf_config(model)
