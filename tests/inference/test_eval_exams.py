"""BIG-Bench Hard and AGIEval: readers on generated fixtures in their published layouts, the
prompts, answer checks on completions written the ways models write them, one-line errors, and
reader -> prompt -> tokens -> generation -> check -> accuracy scoring 100% on planted answers
(a generator stub that answers from the key planted in each question) and 0% on wrong ones."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from anyspeed.inference.eval import exams
from anyspeed.inference.eval.readers import TaskDataError
from helpers.eval_fixtures import write_agieval, write_bbh, write_jsonl


def test_bbh_reader_and_prompts(tmp_path: Path) -> None:
    root = write_bbh(tmp_path, {"date_choice": 3, "web_of_lies": 2}, cot=True)
    tasks = exams.read_bbh(str(root))
    assert sorted(tasks) == ["date_choice", "web_of_lies"]
    raw = json.loads((root / "date_choice.json").read_text())["examples"]
    assert [e.target for e in tasks["date_choice"]] == [r["target"] for r in raw]
    first, second = tasks["web_of_lies"]
    assert exams.bbh_prompt(second, [first]) == (
        f"Q: {first.question}\nA: {first.target}\n\nQ: {second.question}\nA:"
    )
    cot = exams.bbh_cot_prompts(str(root))
    assert exams.bbh_prompt(second, [], cot["web_of_lies"]).endswith(
        f"So the answer is no.\n\nQ: {second.question}\nA: Let's think step by step."
    )


def test_agieval_reader_and_prompts(tmp_path: Path) -> None:
    answers = write_agieval(tmp_path)
    tasks = exams.read_agieval(str(tmp_path))
    assert {t: [e.target.strip("$") for e in es] for t, es in tasks.items()} == answers
    lsat = tasks["lsat-ar"][0]
    assert lsat.options == tuple(f"lsat-ar choice {j}" for j in range(5))  # "(A)" stripped
    text = exams.agieval_prompt(lsat, [tasks["lsat-ar"][1]])
    assert text.startswith("Passage 1 of lsat-ar.\nWhich 1?") and text.endswith(
        f"\nWhich 0? (key: {lsat.target})\nA. lsat-ar choice 0\nB. lsat-ar choice 1\n"
        "C. lsat-ar choice 2\nD. lsat-ar choice 3\nE. lsat-ar choice 4\nAnswer:"
    )
    assert exams.agieval_prompt(tasks["gaokao-physics"][0], []).endswith("\n答案：")


@pytest.mark.parametrize(("completion", "target", "ok"), [
    (" (B)", "(B)", True), (" Let's see. So the answer is (B).", "(B)", True), (" B", "(B)", True),
    (" (C) because (B) is wrong", "(B)", False), (" True.\n\nQ: next", "True", True),
    (" true", "True", True), (" So the answer is 42.", "42", True), (" 421", "42", False),
    ("", "valid", False),
])  # fmt: skip
def test_bbh_answer_check(completion: str, target: str, ok: bool) -> None:
    assert exams.bbh_correct(completion, target) is ok


# The parsing cases of AGIEval's reference scorer (its post_process): single answers take the
# letter after "answer is" / "答案是", else the first capital A-F ("Because" names B); the
# multi-answer exams (jec-qa-kd, jec-qa-ca, gaokao-physics) take every letter A-F, as a set.
@pytest.mark.parametrize(("completion", "task", "target", "ok"), [
    (" A", "lsat-ar", "A", True), (" (B) because", "lsat-ar", "B", True),
    (" Because of C", "lsat-ar", "C", False), (" Because of C", "lsat-ar", "B", True),
    (" D\nA", "lsat-ar", "A", False), (" so the answer is (C).", "sat-math", "C", True),
    (" A. No, the answer is D", "lsat-lr", "D", True), (" 答案是C", "logiqa-zh", "C", True),
    (" (E)", "aqua-rat", "E", True), (" none", "aqua-rat", "A", False),
    (" AC", "jec-qa-kd", "AC", True), (" CA", "jec-qa-ca", "AC", True),
    (" (A)(C)", "gaokao-physics", "AC", True), (" A, C", "jec-qa-kd", "AC", True),
    (" A", "jec-qa-kd", "AC", False), (" ACD", "jec-qa-kd", "AC", False),
    (" B", "gaokao-physics", "B", True), (" BD", "gaokao-physics", "B", False),
    (" AC", "jec-qa-kd", "A", False),
])  # fmt: skip
def test_agieval_choice_follows_the_reference(
    completion: str, task: str, target: str, ok: bool
) -> None:
    item = exams.Exam(task, "q", target, tuple("uvwxyz"))
    assert exams.agieval_correct(completion, item) is ok


@pytest.mark.parametrize(("completion", "target", "ok"), [
    (" $\\frac{1}{2}$", "$\\frac{1}{2}$", True), (" \\frac{1}{2} .", "\\frac{1}{2}", True),
    (" 3", "$\\frac{1}{2}$", False),
])  # fmt: skip
def test_agieval_cloze_check(completion: str, target: str, ok: bool) -> None:
    assert exams.agieval_correct(completion, exams.Exam("math", "q", target)) is ok


@pytest.mark.parametrize(("kind", "content", "message"), [
    ("bbh", {"rows": []}, 'no "examples" list'),
    ("bbh", {"examples": [{"input": "x"}]}, "example 0 lacks input or target"),
    ("agieval", {"question": "q", "options": ["(A)a", "(B)b"], "label": "C"},
     "label 'C' is not a letter of its 2 options"),
    ("agieval", {"question": "q", "options": None, "label": None}, "lacks answer"),
    ("agieval", {"options": None}, "lacks question"),
])  # fmt: skip
def test_bad_exam_data_is_one_line(tmp_path: Path, kind: str, content: dict, message: str) -> None:
    if kind == "bbh":
        (tmp_path / "task.json").write_text(json.dumps(content))
        read = exams.read_bbh
    else:
        write_jsonl(tmp_path / "task.jsonl", [content])
        read = exams.read_agieval
    with pytest.raises(TaskDataError) as err:
        read(str(tmp_path))
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(TaskDataError, match="cot-prompts"):
        exams.bbh_cot_prompts(str(tmp_path))


def _args(task: str, path: Path, **kw) -> argparse.Namespace:
    base = dict(task=task, task_data_path=str(path), num_fewshot=0, max_eval_samples=None,
                use_chat=False, max_length=4096, chain_of_thought=False,
                evaluation_batch_size=3, max_new_tokens=8)  # fmt: skip
    return argparse.Namespace(**dict(base, **kw))


@pytest.mark.parametrize("task", ["bbh", "agieval", "bbh-cot"])
def test_planted_answers_score_100_percent(tmp_path: Path, hf_tok: str, monkeypatch,
                                           task: str) -> None:  # fmt: skip
    from anyspeed.commands import eval_tasks
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.inference import decode
    from anyspeed.inference.generate import decode as detokenize

    tok = load_tokenizer(TokenizerSpec("PretrainedFromHF", hf_tok))
    cot = task == "bbh-cot"
    if task == "agieval":
        write_agieval(tmp_path)
        args = _args(task, tmp_path, num_fewshot=1)
    else:
        root = write_bbh(tmp_path, {"ruin_choice": 5, "navigate": 4}, cot=cot)
        args = _args("bbh", root, num_fewshot=0 if cot else 2, chain_of_thought=cot)
    prep = eval_tasks.PREPARE[args.task](args, tok)
    assert len(prep.prompts) == (5 if task == "bbh" else 9)  # the shots are not scored
    answer = {"right": lambda k: k, "wrong": lambda k: "Z" if len(k) < 3 else "0"}

    for mode, want in (("right", 1.0), ("wrong", 0.0)):

        def stub(model, prompts, req, mode=mode):  # answers the last key planted in the prompt
            keys = [re.findall(r"\(key: ([^)]*\)?)\)", detokenize(tok, p))[-1] for p in prompts]
            if task == "agieval":  # "A, C" for a multi-answer label, the cloze answer as is
                text = [" " + (", ".join(k) if k.isalpha() else k) + "\nmore" for k in keys]
                text = [t if mode == "right" else " Z\n" for t in text]
            else:
                text = [f" So the answer is {answer[mode](k)}.\n\nQ:" for k in keys]
            return tok.encode(text, special=False)

        monkeypatch.setattr(decode, "generate", stub)
        res = eval_tasks.run(args, prep, None, tok)
        assert res["accuracy"] == want and res["total"] == len(prep.prompts), (mode, res)
        assert set(res["groups"]) == set(prep.groups)


def test_hellaswag_reader_and_bad_label(tmp_path: Path) -> None:
    from anyspeed.inference.eval.readers import read_hellaswag

    recs = [{"activity_label": "Baking", "ctx_a": "She mixes flour.", "ctx_b": "then she",
             "endings": ["bakes it.", "swims.", "flies.", "sings."], "label": "0"},
            {"ctx": "A man walks.", "endings": ["a", "b", "c", "d"], "label": 3}]  # fmt: skip
    write_jsonl(tmp_path / "hellaswag_val.jsonl", recs)
    assert read_hellaswag(str(tmp_path)) == [
        ("Baking: She mixes flour. Then she", ("bakes it.", "swims.", "flies.", "sings."), 0),
        ("A man walks.", ("a", "b", "c", "d"), 3),
    ]
    write_jsonl(tmp_path / "hellaswag_val.jsonl", [dict(recs[1], label=4)])
    with pytest.raises(TaskDataError, match=r"hellaswag_val.jsonl:1: label 4 is not an index"):
        read_hellaswag(str(tmp_path))


@pytest.mark.parametrize("task", ["mmlu_ppl", "hellaswag"])
def test_likelihood_tasks_pick_the_best_mean_per_token(tmp_path: Path, hf_tok: str, monkeypatch,
                                                       task: str) -> None:  # fmt: skip
    """Reader -> context and option tokens -> scores -> pick: a stub scorer gives the planted
    option the best mean log-probability per token but a lower sum than the others, so only a
    per-token pick scores 100%."""
    from anyspeed.commands import eval_tasks
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.inference.eval import scoring
    from anyspeed.inference.generate import decode as detokenize
    from helpers.eval_fixtures import write_mmlu

    tok = load_tokenizer(TokenizerSpec("PretrainedFromHF", hf_tok))
    if task == "mmlu_ppl":
        write_mmlu(tmp_path, {"anatomy": 3, "virology": 2}, shots=1, planted=True)
    else:
        endings = ["w x", "y", "z z z", "v"]
        write_jsonl(tmp_path / "hellaswag_val.jsonl", [
            {"ctx": f"Scene {i} (key: {i % 4})", "endings": endings, "label": i % 4}
            for i in range(5)])  # fmt: skip
    args = _args(task, tmp_path, num_fewshot=1, evaluation_batch_size=2)
    prep = eval_tasks.PREPARE[task](args, tok)
    assert len(prep.prompts) == 5 and all(len(x) == 4 for x in prep.extra)

    def stub(model, pairs, batch_size, pad_id, vocab_size):
        out = []
        for k, (ctx, _) in enumerate(pairs):
            key = re.findall(r"\(key: ([ABCD0-3])\)", detokenize(tok, ctx))[-1]
            right = "ABCD0123".index(key) % 4 == k % 4
            out.append((-3.0, 3) if right else (-2.0, 1))
        return out

    monkeypatch.setattr(scoring, "continuation_logprobs", stub)
    res = eval_tasks.run(args, prep, None, tok)
    assert res["accuracy"] == 1.0 and res["total"] == 5, res


def test_ppl_on_a_truncated_bin_names_the_file(tmp_path: Path, hf_tok: str) -> None:
    """``--task ppl`` on a ``.bin`` shorter than its ``.idx`` says so, naming the file (issue 43,
    item 10: Megatron's reader failed without naming it)."""
    import numpy as np

    from anyspeed.commands import eval_tasks
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer
    from anyspeed.data.writer import IndexedWriter

    prefix = str(tmp_path / "docs")
    w = IndexedWriter(prefix, np.int32)
    w.add(np.arange(40, dtype=np.int32), np.array([20, 20]))
    w.finish()
    tok = load_tokenizer(TokenizerSpec("PretrainedFromHF", hf_tok))
    assert len(eval_tasks.PREPARE["ppl"](_args("ppl", Path(prefix)), tok).prompts) == 2
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(60)
    with pytest.raises(TaskDataError) as info:
        eval_tasks.PREPARE["ppl"](_args("ppl", Path(prefix)), tok)
    assert "docs.bin has 60 bytes" in str(info.value) and "--task-data-path" in str(info.value)
