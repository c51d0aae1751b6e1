"""``anyspeed pretrain --fp8-format``: Megatron's FP8 flags through the launcher's parser reach
the model (TP2 + SP here), and bad FP8 requests are one line before any process group starts."""

from __future__ import annotations

import math

import pytest
from test_pretrain import base_args, run_many, write_corpus
from test_pretrain_errors import _error

FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
TP2 = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("data") / "c_text_document"), docs=60)


def test_pretrain_trains_in_fp8(corpus, tmp_path):
    init = str(tmp_path / "init")
    start = ["--load", init, "--finetune"]
    _, fp8, plain = run_many(2, [
        base_args(corpus, 0) + TP2 + FP8 + ["--save", init],
        base_args(corpus, 4) + TP2 + FP8 + start,
        base_args(corpus, 4) + TP2 + start,
    ])  # fmt: skip
    assert all(math.isfinite(x) for x in fp8["loss"]) and len(fp8["loss"]) == 4
    for a, b in zip(fp8["loss"], plain["loss"], strict=True):
        assert a == pytest.approx(b, rel=2e-3)
    assert fp8["loss"] != plain["loss"]  # the GEMMs were quantized


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--optimization-level", "0"], "--fp8-format needs --optimization-level 1"),
        (["--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8 needs Transformer Engine"),
        (
            [
                "--fp8-recipe",
                "delayed",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
            "use --fp8-recipe tensorwise",
        ),  # fmt: skip
        (["--fp8-amax-history-len", "0"], "--fp8-amax-history-len must be >= 1"),
    ],
)
def test_bad_fp8_requests_are_one_line(capsys, corpus, extra, needle):
    argv = base_args(corpus, 2) + ["--fp8-format", "hybrid"] + extra
    assert needle in _error(capsys, argv)


def test_delayed_scaling_with_recompute_that_spares_linears_is_accepted():
    """Selective recompute of the attention core or the norms re-runs no linear layer."""
    from argparse import Namespace

    from anyspeed.device import detect
    from anyspeed.features import registry

    fp8 = registry.get("fp8")
    for modules in (None, ["core_attn", "layernorm", "moe_act"]):
        args = Namespace(fp8="hybrid", fp8_recipe="delayed", recompute_granularity="selective",
                         recompute_modules=modules, optimization_level=2)  # fmt: skip
        fp8.validate(args, detect())
