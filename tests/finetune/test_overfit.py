"""Overfit: full SFT of the tiny model on 32 alpaca samples for 200 full-batch steps
brings the response loss below 0.1, and greedy decoding of each prompt then reproduces its
response exactly."""

from __future__ import annotations

import pytest
from test_sft_loss import cli

from anyspeed.testing import run_distributed
from helpers import sft_ranks
from helpers.corpora import write_jsonl
from helpers.instruction import alpaca_records, preprocess


@pytest.mark.slow
def test_overfit_32_samples(hf_tok, tiny_qwen, tmp_path):
    # Distinct prompts only: two samples with one prompt and two responses cannot both be met.
    unique = {r["instruction"]: r for r in alpaca_records(64, seed=5)}
    records = list(unique.values())[:32]
    assert len(records) == 32
    src = write_jsonl(str(tmp_path / "a.jsonl"), records)
    prefix = preprocess(src, str(tmp_path / "o"), hf_tok)
    argv = cli(
        tiny_qwen,
        prefix,
        "--lr-decay-style",
        "constant",
        "--weight-decay",
        "0",
        "--log-interval",
        "50",
        gbs=32,
    )
    argv[argv.index("--train-iters") + 1] = "200"
    argv[argv.index("--lr") + 1] = "5e-3"
    argv[argv.index("--micro-batch-size") + 1] = "32"
    out = run_distributed(sft_ranks.overfit, 1, argv=argv, cli=argv, prefix=prefix, timeout=2400)[0]
    assert out["loss"][-1] < 0.1, out["loss"][::20]
    wrong = [i for i, (got, want) in enumerate(out["pairs"]) if got != want]
    assert not wrong, f"{len(wrong)} of 32 responses differ, e.g. {out['pairs'][wrong[0]]}"
