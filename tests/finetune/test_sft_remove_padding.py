"""SFT's ``--use-remove-padding``: unpacked samples packed at run time, each micro-batch one
``thd`` sequence, no padding computed. Its first loss is transformers' (each sample alone),
3 steps equal the padded run within 1e-5 (full and LoRA); at TP2+SP, PP2 and DP2 it equals one
padded process (``-m slow``); bad flags are one line, and the PRM stage refuses it."""

from __future__ import annotations

import pytest
from test_posttrain_errors import _error
from test_sft_loss import TOL, cli, hf_token_mean

from anyspeed.testing import run_distributed
from helpers import sft_ranks

PAD = ["--optimization-level", "1", "--train-iters", "3"]
PACK = [*PAD, "--use-remove-padding"]


def _same(got: dict, want: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)


def test_packed_at_run_time_equals_padded(sft_data, tiny_qwen):
    lora = ["--lora-target-modules", "linear_qkv", "linear_fc1", "--lora-r", "4"]
    clis = [cli(tiny_qwen, sft_data["padded"], *x, *extra)
            for extra in ([], lora) for x in (PAD, PACK)]  # fmt: skip
    pad, pack, lora_pad, lora_pack = run_distributed(sft_ranks.posttrain_many, 1, argv=clis[0],
                                                     clis=clis, timeout=300)[0]  # fmt: skip
    assert pack["loss"][0] == pytest.approx(hf_token_mean(tiny_qwen, sft_data["padded"]), rel=TOL)
    _same(pack, pad)
    _same(lora_pack, lora_pad)
    assert len(set(pad["loss"])) == 3  # it trained


@pytest.mark.parametrize(
    ("extra", "message", "data"),
    [
        (["--use-remove-padding", "--optimization-level", "0"], "--optimization-level 1", "padded"),
        (
            [
                "--use-remove-padding",
                "--optimization-level",
                "1",
                "--neat-pack",
                "--reset-attention-mask",
            ],
            "packed already",
            "packed",
        ),  # fmt: skip
    ],
)
def test_bad_flags_are_one_line(extra, message, data, capsys, sft_data, tiny_qwen):
    seq = 192 if data == "packed" else 96
    assert message in _error(capsys, cli(tiny_qwen, sft_data[data], *extra, seq=seq))


LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel", *PACK],
    "pp2": ["--pipeline-model-parallel-size", "2", *PACK],
    "dp2": ["--use-distributed-optimizer", *PACK],
}


@pytest.mark.slow
def test_layouts_equal_one_padded_process(sft_data, tiny_qwen):
    one = cli(tiny_qwen, sft_data["padded"], *PAD)
    ref = run_distributed(sft_ranks.posttrain, 1, argv=one, cli=one, timeout=300)[0]
    argvs = [cli(tiny_qwen, sft_data["padded"], *f) for f in LAYOUTS.values()]
    out = run_distributed(sft_ranks.posttrain_many, 2, argv=argvs[0], clis=argvs, timeout=600)
    for name, got in zip(LAYOUTS, out[0], strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=TOL), name
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL), name


def test_prm_refuses_it_in_one_line(capsys, step_data, tiny_qwen, hf_tok):
    from test_prm import cli as prm_cli

    argv = prm_cli(tiny_qwen, step_data, hf_tok, "--use-remove-padding", "--optimization-level",
                   "1")  # fmt: skip
    assert "--stage prm --use-remove-padding is not supported" in _error(capsys, argv)
