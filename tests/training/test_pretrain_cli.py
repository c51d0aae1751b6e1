"""``anyspeed pretrain`` end to end from the command line: trained tokenizer, preprocessed
data, TP=2 with sequence parallelism under torchrun, log lines, metrics file, TensorBoard events
(read back with TensorBoard's own reader) and a generated sample."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from anyspeed.commands.preprocess import main as data_main
from helpers.corpora import make_docs, write_jsonl


def test_pretrain_command_end_to_end(tmp_path, hf_tok):
    corpus = write_jsonl(str(tmp_path / "c.jsonl"), [{"text": d} for d in make_docs(400, 3)])
    prefix = str(tmp_path / "c")
    assert data_main(["preprocess", "--input", corpus, "--output-prefix", prefix,
                      "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", hf_tok,
                      "--append-eod", "--quiet"]) == 0  # fmt: skip
    tb, metrics = str(tmp_path / "tb"), str(tmp_path / "m.jsonl")
    cmd = [
        sys.executable, "-m", "anyspeed", "pretrain", "--nproc-per-node", "2",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--model", "tiny-qwen2.5",
        "--padded-vocab-size", "640", "--seq-length", "64", "--micro-batch-size", "4",
        "--global-batch-size", "8", "--train-iters", "10", "--lr", "3e-3",
        "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", hf_tok,
        "--data-path", prefix + "_text_document", "--split", "95,5,0",
        "--eval-interval", "5", "--eval-iters", "1",
        "--log-interval", "2", "--tensorboard-dir", tb, "--metrics-file", metrics,
        "--save", str(tmp_path / "ck"), "--generate-prompt", "the model trains",
        "--generate-tokens", "4",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    logs = [line for line in out.stdout.splitlines() if line.startswith(" iteration")]
    assert len(logs) == 5
    for field in ("learning rate", "lm loss", "grad norm", "tokens/s", "TFLOP/s", "MFU",
                  "peak mem"):  # fmt: skip
        assert field in logs[-1]
    assert "validation loss at iteration 5" in out.stdout
    assert "sample:" in out.stdout
    # where MFU's peak came from, once, before the first iteration
    said = [line for line in out.stdout.splitlines() if ": MFU " in line]
    assert len(said) == 1 and out.stdout.index(said[0]) < out.stdout.index(logs[0]), said
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["iteration"] for r in rows] == [2, 4, 6, 8, 10]
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb)
    acc.Reload()
    events = acc.Scalars("lm-loss")
    assert [e.step for e in events] == [2, 4, 6, 8, 10]
    for e, r in zip(events, rows, strict=True):
        assert abs(e.value - r["lm_loss"]) < 1e-5
    assert os.path.isdir(tmp_path / "ck" / "iter_0000010")
