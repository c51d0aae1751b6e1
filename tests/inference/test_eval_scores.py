"""``anyspeed evaluate``'s scores can be trusted: BoolQ answers are parsed (the string "false"
is false), nothing scored is an error, and bad --execution-timeout / --output-json values or a
missing code-execution opt-in are one line before any work; results survive a failed write."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest

from anyspeed.commands import eval_tasks, evaluate
from anyspeed.commands.session import InferenceRun
from anyspeed.inference.eval import execution, readers
from anyspeed.inference.eval.readers import TaskDataError
from anyspeed.layout import Layout
from helpers.convert_ranks import tiny_hf_model
from helpers.eval_fixtures import write_jsonl


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, hf_tok: str) -> str:
    """A tiny random Qwen2.5 directory with the shared test tokenizer."""
    d = tmp_path_factory.mktemp("scores") / "hf"
    tiny_hf_model(d, "tiny-qwen2.5", seed=1, vocab_size=600)
    for name in os.listdir(hf_tok):
        shutil.copy(os.path.join(hf_tok, name), d / name)
    return str(d)


@pytest.fixture
def boolq(tmp_path: Path) -> str:
    write_jsonl(tmp_path / "boolq" / "dev.jsonl",
                [{"question": "is it", "passage": "it is", "answer": True}])  # fmt: skip
    return str(tmp_path / "boolq")


def _lines(capsys, argv: list[str], code: int = 2) -> list[str]:
    assert evaluate.main(argv) == code
    return capsys.readouterr().err.strip().splitlines()


def test_boolq_answers_are_parsed_not_truth_tested(tmp_path: Path) -> None:
    answers = [True, False, "false", "False", " TRUE ", "true", 0, 1, "0", "1"]
    write_jsonl(tmp_path / "dev.jsonl", [{"question": f"q{i}", "passage": "p", "answer": a}
                                         for i, a in enumerate(answers)])  # fmt: skip
    got = [a for _, _, a in readers.read_boolq(str(tmp_path))]
    assert got == [True, False, False, False, True, True, False, True, False, True]
    for bad in ("maybe", 2, 1.0, None, [], "yes"):
        write_jsonl(tmp_path / "dev.jsonl", [
            {"question": "q", "passage": "p", "answer": True},
            {"question": "q", "passage": "p", "label": bad}])  # fmt: skip
        with pytest.raises(TaskDataError) as info:
            readers.read_boolq(str(tmp_path))
        msg = str(info.value)
        assert "\n" not in msg and "dev.jsonl: record 2" in msg, msg


def test_nothing_to_score_is_an_error(capsys, hf_dir: str, tmp_path: Path) -> None:
    (tmp_path / "dev.jsonl").write_text("\n")
    err = _lines(capsys, ["--load", hf_dir, "--task", "boolq", "--task-data-path",
                          str(tmp_path)])  # fmt: skip
    assert len(err) == 1 and "no item to score" in err[0], err


def _run(args: argparse.Namespace) -> InferenceRun:
    """A run around ``args`` for the command's body (no model: ``eval_tasks.run`` is stubbed)."""
    return InferenceRun("anyspeed evaluate", args, None, Layout(), args.load, None, None)


def test_nothing_scored_after_the_run_is_an_error(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(eval_tasks, "run", lambda *a: eval_tasks.accuracy_table([], []))
    args = argparse.Namespace(task="boolq", output_json=None, load="x")
    with pytest.raises(ValueError, match="no item was scored"):
        evaluate._body(_run(args), [])


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_execution_timeout_must_be_positive(capsys, hf_dir: str, boolq: str,
                                            value: str) -> None:  # fmt: skip
    err = _lines(capsys, ["--load", hf_dir, "--task", "boolq", "--task-data-path", boolq,
                          "--execution-timeout", value])  # fmt: skip
    assert len(err) == 1 and f"--execution-timeout {value}" in err[0].replace("-nan", "nan")


def test_human_eval_needs_the_opt_in(capsys, monkeypatch, hf_dir: str) -> None:
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    argv = ["--load", hf_dir, "--task", "human_eval", "--max-length", "8"]
    err = _lines(capsys, argv)
    assert len(err) == 1 and "--allow-code-execution" in err[0], err
    assert "HF_ALLOW_CODE_EVAL=1" in err[0]
    # opted in (the flag, or lm-eval's variable): the missing protections are named before
    # anything runs; here the too-short context then stops it
    monkeypatch.setattr(execution, "probe", lambda: {"network-namespace": "Operation not "
                                                     "permitted (EPERM)"})  # fmt: skip
    for extra, env in (([], "1"), (["--allow-code-execution"], None)):
        if env:
            monkeypatch.setenv("HF_ALLOW_CODE_EVAL", env)
        else:
            monkeypatch.delenv("HF_ALLOW_CODE_EVAL")
        err = _lines(capsys, argv + extra)
        assert len(err) == 2 and "warning: HumanEval sandbox: no network-namespace" in err[0]
        assert "EPERM" in err[0] and "over the context" in err[1], err


def test_unwritable_output_json_is_refused_before_the_run(capsys, hf_dir: str, boolq: str,
                                                          tmp_path: Path) -> None:  # fmt: skip
    for path in (tmp_path / "no-such-dir" / "out.json", tmp_path):
        err = _lines(capsys, ["--load", hf_dir, "--task", "boolq", "--task-data-path", boolq,
                              "--output-json", str(path)])  # fmt: skip
        assert len(err) == 1 and f"--output-json {path}: cannot be written" in err[0], err
    existing = tmp_path / "old.json"
    existing.write_text("keep")
    evaluate._check_output(str(existing))  # writable; checking it changes nothing
    assert existing.read_text() == "keep"
    fresh = tmp_path / "fresh.json"
    evaluate._check_output(str(fresh))
    assert not fresh.exists()


def test_results_are_printed_when_the_final_write_fails(capsys, monkeypatch,
                                                        tmp_path: Path) -> None:  # fmt: skip
    res = eval_tasks.accuracy_table(["boolq", "boolq"], [True, False])
    monkeypatch.setattr(eval_tasks, "run", lambda *a: dict(res, picks=[0, 1]))
    gone = tmp_path / "gone"  # checked before the run, removed during it
    args = argparse.Namespace(task="boolq", output_json=str(gone / "r.json"), load="ckpt")
    with pytest.raises(ValueError) as info:
        evaluate._body(_run(args), [])
    msg = str(info.value)
    assert "\n" not in msg and f"--output-json {gone / 'r.json'}: could not write" in msg
    out = capsys.readouterr().out
    doc = json.loads(out[out.index("{") :])
    assert doc["picks"] == [0, 1] and doc["correct"] == 1 and doc["task"] == "boolq"
