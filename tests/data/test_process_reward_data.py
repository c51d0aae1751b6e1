"""Step-labelled data (AlpacaStyleProcessRewardHandler): the text tokenized whole as
transformers tokenizes it, -100 everywhere but at each placeholder token, where the step's
label token sits; bad records skipped and counted with their reason; bad flags one line."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.corpora import dataset_dtype, read_back, run_cli, write_jsonl
from helpers.prm import PLACEHOLDER, step_records

IGNORE = -100
HANDLER = "AlpacaStyleProcessRewardHandler"
KEYS = ("input_ids", "attention_mask", "labels")


def _run(capsys, tmp_path, hf_tok, src, *flags, ok=True) -> tuple[str, str]:
    prefix = str(tmp_path / "steps")
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix", prefix,
                      "--tokenizer-name-or-path", hf_tok, "--handler-name", HANDLER,
                      *flags)  # fmt: skip
    assert (rc == 0) == ok, err
    return prefix, err


def _enc(auto_tok, text: str) -> list[int]:
    return auto_tok(text, add_special_tokens=False)["input_ids"]


def test_labels_sit_on_the_placeholders(tmp_path, capsys, hf_tok, auto_tok):
    recs = step_records(6, seed=2)
    recs.append({"input": "one @ two @", "value": [True, False]})  # TRL's booleans
    recs.append({"q": "x @", "v": ["-"]})  # read with --map-keys below
    src = write_jsonl(str(tmp_path / "s.jsonl"), recs[:-1])
    prefix, err = _run(capsys, tmp_path, hf_tok, src, "--placeholder-token", PLACEHOLDER,
                       "--reward-tokens", "+", "-")  # fmt: skip
    assert f"{len(recs) - 1} documents read, {len(recs) - 1} written" in err
    out = {k: read_back(f"{prefix}_packed_{k}_document") for k in KEYS}
    assert dataset_dtype(f"{prefix}_packed_labels_document") == np.int32
    tag, plus, minus = (_enc(auto_tok, t)[0] for t in (PLACEHOLDER, "+", "-"))
    for n, rec in enumerate(recs[:-1]):
        ids = _enc(auto_tok, rec["input"])
        want = [IGNORE] * len(ids)
        steps = [i for i, t in enumerate(ids) if t == tag]
        for i, v in zip(steps, rec["value"], strict=True):
            want[i] = plus if v in ("+", True) else minus
        assert out["input_ids"][n] == ids
        assert out["labels"][n] == want
        assert out["attention_mask"][n] == [1] * len(ids)
    mapped = write_jsonl(str(tmp_path / "m.jsonl"), recs[-1:])
    prefix, err = _run(capsys, tmp_path, hf_tok, mapped, "--placeholder-token", PLACEHOLDER,
                       "--reward-tokens", "+", "-", "--map-keys", '{"input":"q","value":"v"}',
                       "--overwrite")  # fmt: skip
    assert read_back(f"{prefix}_packed_labels_document")[0][-1] == minus


def test_trl_stepwise_records(tmp_path, capsys, hf_tok, auto_tok):
    """TRL's ``{prompt, completions, labels}`` read as ``prompt\nstep @\nstep @``, booleans
    to the reward tokens; a placeholder inside a step is taken out of it."""
    recs = [
        {"prompt": "Add to 3.", "completions": ["3 + 1 = 4", "4 + 1 = 6"], "labels": [True, False]},
        {"prompt": "Add to 5.", "completions": ["5 + 1 = 6 @ ok"], "labels": [True]},
    ]
    src = write_jsonl(str(tmp_path / "trl.jsonl"), recs)
    prefix, err = _run(capsys, tmp_path, hf_tok, src, "--placeholder-token", PLACEHOLDER,
                       "--reward-tokens", "+", "-")  # fmt: skip
    assert "2 documents read, 2 written" in err
    ids = read_back(f"{prefix}_packed_input_ids_document")
    labels = read_back(f"{prefix}_packed_labels_document")
    plus, minus = _enc(auto_tok, "+")[0], _enc(auto_tok, "-")[0]
    texts = ["Add to 3.\n3 + 1 = 4 @\n4 + 1 = 6 @", "Add to 5.\n5 + 1 = 6  ok @"]
    for n, (text, want) in enumerate(zip(texts, ([plus, minus], [plus]), strict=True)):
        assert ids[n] == _enc(auto_tok, text)
        assert [x for x in labels[n] if x != IGNORE] == want


def test_bad_records_are_skipped_and_counted(tmp_path, capsys, hf_tok):
    ok = {"input": "1 + 1 = 2 @", "value": ["+"]}
    recs = [
        ok,
        {"input": "1 + 1 = 2 @ 2 + 1 = 3 @", "value": ["+"]},  # two steps, one label
        {"input": "no step here", "value": ["+"]},
        {"input": "1 + 1 = 3 @", "value": ["?"]},  # not a reward token
        {"input": "1 + 1 = 2 @", "value": "+"},  # not a list
        {"input": "1 + 1 = 2 @" * 40, "value": ["+"] * 40},  # too long
        ok,
    ]
    src = write_jsonl(str(tmp_path / "b.jsonl"), recs)
    _, err = _run(capsys, tmp_path, hf_tok, src, "--placeholder-token", PLACEHOLDER,
                  "--reward-tokens", "+", "-", "--seq-length", "64")  # fmt: skip
    assert f"{len(recs)} documents read, 2 written" in err
    for reason in ("steps and labels differ: 1", "no step: 1", "bad label: 1",
                   "labels not a list: 1", "longer than --seq-length: 1"):  # fmt: skip
        assert reason in err, err
    assert "b.jsonl:2: steps and labels differ (2 placeholder tokens, 1 labels)" in err
    assert "merges" not in err
    # A placeholder the tokenizer merges with its neighbours ("t" inside "the") is named.
    src = write_jsonl(str(tmp_path / "t.jsonl"), [{"input": "the end t", "value": ["+", "+"]}])
    _, err = _run(capsys, tmp_path, hf_tok, src, "--placeholder-token", "t", "--reward-tokens",
                  "+", "-", "--overwrite", ok=False)  # fmt: skip
    assert "2 labels; the text has 2, so the tokenizer merges the placeholder" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--placeholder-token", "ки"), "--placeholder-token 'ки' is 4 tokens"),
        (("--reward-tokens", "good", "-", "--placeholder-token", "@"), "--reward-tokens 'good'"),
        (
            ("--placeholder-token", "+", "--reward-tokens", "+", "-"),
            "--reward-tokens must be distinct, and differ from --placeholder-token",
        ),
        (("--prompt-type", "qwen", "--placeholder-token", "@"), "do not apply"),
    ],
)
def test_bad_flags_are_one_line(tmp_path, capsys, hf_tok, flags, message):
    src = write_jsonl(str(tmp_path / "s.jsonl"), step_records(2))
    _, err = _run(capsys, tmp_path, hf_tok, src, *flags, ok=False)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], err


def test_step_flags_belong_to_the_step_handler(tmp_path, capsys, hf_tok):
    src = write_jsonl(str(tmp_path / "s.jsonl"), [{"text": "a"}])
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix",
                      str(tmp_path / "p"), "--tokenizer-name-or-path", hf_tok,
                      "--placeholder-token", "@")  # fmt: skip
    assert rc == 2 and "apply to AlpacaStyleProcessRewardHandler" in err
