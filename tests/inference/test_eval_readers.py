"""Benchmark readers on generated fixtures in each layout, prompts, answer extraction, and the
answer-letter pipeline scoring 100% on planted answers (a stub that reads the planted key)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from anyspeed.inference.eval import answers, prompts, readers
from anyspeed.inference.eval.readers import TaskDataError
from anyspeed.inference.eval.scoring import pick_choices
from helpers.eval_fixtures import write_ceval, write_cmmlu, write_jsonl, write_mmlu


def _answers(tests: dict) -> dict:
    return {s: ["ABCD"[q.answer] for q in qs] for s, qs in tests.items()}


def test_mmlu_layout(tmp_path: Path) -> None:
    want = write_mmlu(tmp_path, {"anatomy": 3, "college_physics": 2}, shots=2)
    tests = readers.read_choices(str(tmp_path), "mmlu", "test")
    assert _answers(tests) == want
    q = tests["anatomy"][0]
    assert q.question.startswith('Question 0 on anatomy: which one, "quoted"?')
    assert len(q.options) == 4 and q.options[0].startswith("anatomy option 0,")
    assert {s: len(v) for s, v in readers.read_choices(str(tmp_path), "mmlu", "dev").items()} == {
        "anatomy": 2, "college_physics": 2}  # fmt: skip


def test_cmmlu_and_ceval_layouts(tmp_path: Path) -> None:
    want = write_cmmlu(tmp_path / "c", {"chinese_history": 3})
    assert _answers(readers.read_choices(str(tmp_path / "c"), "cmmlu", "test")) == want
    want = write_ceval(tmp_path / "e", {"law": 2, "physics": 3})
    assert _answers(readers.read_choices(str(tmp_path / "e"), "ceval", "val")) == want
    assert len(readers.read_choices(str(tmp_path / "e"), "ceval", "dev")["law"]) == 2


def test_boolq_gsm8k_and_humaneval_files(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "boolq" / "dev.jsonl", [
        {"question": "is it", "passage": "p1", "answer": True},
        {"question": "is it not", "passage": "p2", "label": 0}])  # fmt: skip
    assert readers.read_boolq(str(tmp_path / "boolq")) == [("p1", "is it", True),
                                                           ("p2", "is it not", False)]  # fmt: skip
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl",
                [{"question": "2+2?", "answer": "Add them.\n#### 1,004"}])  # fmt: skip
    assert readers.read_gsm8k(str(tmp_path / "gsm8k")) == [("2+2?", "1,004")]
    assert len(readers.read_humaneval(None)) == 164


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: None, "no such file or directory"),
        (lambda d: (d / "x_test.csv").write_text("q,a,b,c,d,E\n"), "not one of A, B, C, D"),
        (lambda d: (d / "x_test.csv").write_text("q,a,b\n"), "expected question, A, B, C, D"),
        (lambda d: (d / "x_dev.csv").write_text("q,a,b,c,d,A\n"), "no mmlu test CSV files"),
    ],
)
def test_bad_choice_data_is_one_line(tmp_path: Path, make, message: str) -> None:
    root = tmp_path / "data"
    if make(root.mkdir() or root) is None and message.startswith("no such"):
        root = tmp_path / "missing"
    with pytest.raises(TaskDataError, match=message) as info:
        readers.read_choices(str(root), "mmlu", "test")
    assert "\n" not in str(info.value)


def test_bad_jsonl_names_the_line(tmp_path: Path) -> None:
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "1"}\n{oops\n')
    with pytest.raises(TaskDataError, match=r"test.jsonl:2: not JSON"):
        readers.read_gsm8k(str(tmp_path))
    with pytest.raises(TaskDataError, match="no such file"):
        readers.read_humaneval(str(tmp_path / "nope.jsonl"))


def test_prompts_and_answer_extraction() -> None:
    q = readers.Choice("high_school_math", "1+1?", ("1", "2", "3", "4"), 1)
    text = prompts.choice_prompt(q, [q])
    assert text == ("The following are multiple choice questions (with answers) about high "
                    "school math.\n\n1+1?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer: B\n\n"
                    "1+1?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer:")  # fmt: skip
    assert answers.extract_number(" So 3 + 4 = 7. The answer is 1,234.\n\nQuestion: x") == "1234"
    assert answers.extract_number("we get 12 then -5.0") == "-5"
    assert answers.extract_number("no digits") is None
    # issue 43, item 8: the number after "The answer is:" wins over a later one
    assert answers.extract_number("The answer is: 42 because 6*7") == "42"
    assert answers.extract_number("The answer is: $1,000.") == "1000"


def test_planted_answers_score_100_percent(tmp_path: Path, auto_tok) -> None:
    """Reader -> prompt -> tokens -> pick -> accuracy, with a scorer that answers from the key
    planted in each question: every stage must keep questions, letters and answers aligned."""
    from anyspeed.commands.eval_tasks import accuracy_table

    write_mmlu(tmp_path, {"anatomy": 5, "virology": 4}, shots=1, planted=True)
    tests = readers.read_choices(str(tmp_path), "mmlu", "test")
    dev = readers.read_choices(str(tmp_path), "mmlu", "dev")
    items = [(s, q) for s, qs in sorted(tests.items()) for q in qs]
    ids = [auto_tok(prompts.choice_prompt(q, dev[s]))["input_ids"] for s, q in items]
    letters = [auto_tok(" " + c)["input_ids"][-1] for c in "ABCD"]

    def stub(batch):  # the last planted key in the prompt gets the top logit
        out = torch.zeros(len(batch), len(auto_tok))
        for row, p in enumerate(batch):
            key = re.findall(r"\(key: ([ABCD])\)", auto_tok.decode(p))[-1]
            out[row, letters["ABCD".index(key)]] = 1.0
        return out

    picks = pick_choices(stub, ids, letters, batch_size=4)
    res = accuracy_table([s for s, _ in items], [p == q.answer for p, (_, q) in
                                                 zip(picks, items, strict=True)])  # fmt: skip
    assert res["accuracy"] == 1.0 and res["total"] == 9
    wrong = accuracy_table(["a"], [False])
    assert wrong["accuracy"] == 0.0


def test_files_that_are_not_text_name_the_file(tmp_path: Path) -> None:
    """An MMLU CSV of random bytes, or a jsonl.gz that is not gzip, is one TaskDataError line
    naming the file (issue 43, item 10: a UnicodeDecodeError traceback before)."""
    import random

    write_mmlu(tmp_path, {"anatomy": 2}, shots=1)
    bad = next(tmp_path.rglob("anatomy_test.csv"))
    bad.write_bytes(bytes(random.Random(0).randrange(128, 256) for _ in range(200)))
    with pytest.raises(readers.TaskDataError) as info:
        readers.read_choices(str(tmp_path), "mmlu", "test")
    assert str(bad) in str(info.value) and "not UTF-8 text" in str(info.value)
    gz = tmp_path / "x.jsonl.gz"
    gz.write_bytes(b"not gzip at all")
    with pytest.raises(readers.TaskDataError, match="x.jsonl.gz: cannot be read as UTF-8 jsonl"):
        readers.read_jsonl(str(gz))
