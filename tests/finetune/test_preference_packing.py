"""Remove-padding in the pairwise stages (``--use-remove-padding``): each micro-batch's chosen
and rejected sequences reach the model as one packed ``thd`` sequence. Packed DPO's first step
reads transformers' answer log-probs (loss ln 2); DPO (full and LoRA), SimPO and the reward
model packed, and DPO with a dynamic batch size (``--use-dynamic-bsz``: a step's pairs split by
a token budget), equal the same runs padded within 1e-5 over 3 steps; at TP2+SP, PP2 (one
packed length a step) and DP2 packed DPO, and at PP2 and DP2 with a dynamic batch size, equals
one padded process (``-m slow``); bad flags are one line."""

from __future__ import annotations

import math

import pytest
from test_dpo import TOL, cli, hf_pair_logps, mean
from test_posttrain_errors import _error

from anyspeed.testing import run_distributed
from helpers import sft_ranks

PACK = ["--use-remove-padding", "--optimization-level", "1"]
PAD = ["--optimization-level", "1"]
DYNAMIC = [*PACK, "--use-dynamic-bsz", "--max-packing-token-size", "400"]  # 2-3 pairs
KEYS = ("rewards/margins", "rewards/chosen", "rewards/rejected")


def _same(got: dict, want: dict, keys: tuple[str, ...] = KEYS) -> None:
    """Loss and grad norm within 1e-5; the rewards (beta times differences of answer log-prob
    sums of about 70 in fp32, whose last bits differ between the packed and padded kernels)
    within 2e-5."""
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)
    for k in keys:
        assert got["metrics"][k] == pytest.approx(want["metrics"][k], rel=TOL, abs=2e-5), k


def test_packed_equals_padded(pair_data, tiny_qwen):
    """DPO, DPO-LoRA, SimPO and the reward model, 3 steps each, packed against padded (two
    pairs a micro-batch: four sequences of their own lengths in one packed sequence)."""
    lora = ["--lora-target-modules", "linear_qkv", "linear_fc1", "--lora-r", "4"]
    kinds = {
        "dpo": ([], PACK, "dpo", KEYS + ("logps/chosen", "logps/rejected")),
        "dpo-lora": (lora, PACK, "dpo", KEYS),
        "simpo": ([], PACK, "simpo", KEYS),
        "orm": ([], PACK, "orm", KEYS),
        "dpo-dynamic": ([], DYNAMIC, "dpo", KEYS),  # micro-batches by a token budget
    }
    clis = []
    for extra, packed, stage, _ in kinds.values():
        clis += [cli(tiny_qwen, pair_data, *extra, *x, stage=stage, iters=3) for x in (PAD, packed)]
    out = run_distributed(sft_ranks.posttrain_many, 1, argv=clis[0], clis=clis, timeout=600)[0]
    for i, (name, (_, _, _, keys)) in enumerate(kinds.items()):
        pad, pack = out[2 * i], out[2 * i + 1]
        assert max(pack["grad_norm"]) > 0, name
        _same(pack, pad, keys)
    pc, pr, _, _ = hf_pair_logps(tiny_qwen, pair_data)  # packed DPO reads transformers' sums
    m = out[1]["metrics"]
    assert out[1]["loss"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert m["logps/chosen"][0] == pytest.approx(mean(pc), rel=TOL)
    assert m["logps/rejected"][0] == pytest.approx(mean(pr), rel=TOL)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--use-remove-padding", "--optimization-level", "0"], "--optimization-level 1"),
        (
            ["--use-remove-padding", "--optimization-level", "2", "--context-parallel-size", "2"],
            "--context-parallel-size > 1 is not",
        ),
        (["--use-dynamic-bsz"], "add --use-remove-padding"),
        ([*DYNAMIC[:-1], "150"], "below 2 x --seq-length 96 = 192"),
    ],
)
def test_bad_flags_are_one_line(extra, message, capsys, pair_data, tiny_qwen):
    assert message in _error(capsys, cli(tiny_qwen, pair_data, *extra))


LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel", *PACK],
    "pp2": ["--pipeline-model-parallel-size", "2", *PACK],
    "dp2": ["--use-distributed-optimizer", *PACK],
    "pp2-dynamic": ["--pipeline-model-parallel-size", "2", *DYNAMIC],
    "dp2-dynamic": ["--use-distributed-optimizer", *DYNAMIC],
}


@pytest.mark.slow
def test_packed_layouts_equal_one_padded_process(pair_data, tiny_qwen):
    """4 steps of packed DPO at TP2+SP, PP2 and DP2 (by count and by a token budget) against
    one padded process."""
    one = cli(tiny_qwen, pair_data, *PAD, iters=4)
    ref = run_distributed(sft_ranks.posttrain, 1, argv=one, cli=one, timeout=300)[0]
    argvs = [cli(tiny_qwen, pair_data, *flags, iters=4) for flags in LAYOUTS.values()]
    out = run_distributed(sft_ranks.posttrain_many, 2, argv=argvs[0], clis=argvs, timeout=600)
    for i, name in enumerate(LAYOUTS):
        got = out[0][i]
        assert got["loss"] == pytest.approx(ref["loss"], rel=TOL, abs=1e-7), name
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL), name
