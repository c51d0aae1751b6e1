"""NeedleBench single-needle retrieval: the reader on its layout (one-line errors), prompts
that fit each length with the needle once at its depth, and reader -> prompt -> tokens ->
generation -> keyword check -> accuracy scoring 100% with a generator stub that answers the
needle it finds in the prompt (0% when it answers another)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from anyspeed.inference.eval import needle as N
from anyspeed.inference.eval.readers import TaskDataError
from helpers.eval_fixtures import NEEDLES, write_jsonl, write_needlebench


@pytest.fixture
def tok(hf_tok: str):  # noqa: ANN201 - anyspeed's tokenizer
    from anyspeed.data.tokenizer import TokenizerSpec, load_tokenizer

    return load_tokenizer(TokenizerSpec("PretrainedFromHF", hf_tok))


def test_reader_and_bad_data(tmp_path: Path) -> None:
    needles, stacks = N.read_needlebench(str(write_needlebench(tmp_path / "ok")))
    assert [n.keyword for n in needles] == [k for _, _, k, _ in NEEDLES]
    assert {s.name: s.language for s in stacks} == {"essays": "English", "zh_notes": "Chinese"}
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(TaskDataError, match="no needles.jsonl"):
        N.read_needlebench(str(bad))
    write_jsonl(bad / "needles.jsonl", [{"needle": "x", "retrieval_question": "y"}])
    with pytest.raises(TaskDataError, match=r"needles.jsonl:1: a needle lacks arg2"):
        N.read_needlebench(str(bad))
    write_jsonl(bad / "needles.jsonl", [{"needle": "x", "retrieval_question": "y", "arg2": "z"}])
    write_jsonl(bad / "hay.jsonl", [{"title": "no text"}])
    with pytest.raises(TaskDataError, match='hay.jsonl: no "text"'):
        N.read_needlebench(str(bad))


@pytest.mark.parametrize("length", [400, 900])
def test_prompts_fit_and_hold_the_needle_at_its_depth(tmp_path: Path, tok, length: int) -> None:
    from anyspeed.inference.generate import decode

    needles, stacks = N.read_needlebench(str(write_needlebench(tmp_path)))
    essays = next(s for s in stacks if s.name == "essays")

    def encode(text: str) -> list[int]:
        return tok.encode([text], special=False)[0]

    where = []
    for depth in N.DEPTHS:
        text = N.build_prompt(encode(essays.text[:4000]), needles[0], length, depth,
                              lambda t: len(encode(t)), lambda ids: decode(tok, ids))  # fmt: skip
        assert len(encode(text)) <= length and text.count(needles[0].text) == 1
        assert text.endswith(f"{needles[0].question}\nAnswer:")
        context = text.split("\n\nAnswer from the document:")[0]
        context = context.removeprefix("This is a long document:\n")
        where.append(context.index(needles[0].text) / len(context))
    assert where[0] == 0 and where == sorted(where) and where[-1] > 0.8, where
    mid = zip(where[1:-1], N.DEPTHS[1:-1], strict=True)
    assert all(abs(w - d / 100) < 0.15 for w, d in mid), where


def _args(path: Path) -> argparse.Namespace:
    return argparse.Namespace(task="needlebench", task_data_path=str(path), num_fewshot=0,
                              max_eval_samples=None, use_chat=False, max_length=1024,
                              evaluation_batch_size=4, max_new_tokens=16,
                              needle_lengths=[200, 300], needle_depths=[0, 50, 100])  # fmt: skip


def test_planted_answers_score_100_percent(tmp_path: Path, tok, monkeypatch) -> None:
    from anyspeed.commands import eval_tasks
    from anyspeed.inference import decode
    from anyspeed.inference.generate import decode as detokenize

    args = _args(write_needlebench(tmp_path))
    prep = eval_tasks.PREPARE["needlebench"](args, tok)
    assert len(prep.prompts) == 2 * 2 * 3 and prep.extra == [0, 50, 100] * 4
    keywords = [k for _, _, k, _ in NEEDLES]
    for mode, want in (("right", 1.0), ("wrong", 0.0)):

        def stub(model, prompts, req, mode=mode):  # answers the needle it finds in the prompt
            texts = [detokenize(tok, p) for p in prompts]
            hits = [next(k for n, _, k, _ in NEEDLES if n in t) for t in texts]
            hits = hits if mode == "right" else [keywords[keywords.index(h) - 1] for h in hits]
            return tok.encode([f" It is {h}.\n\nmore" for h in hits], special=False)

        monkeypatch.setattr(decode, "generate", stub)
        res = eval_tasks.run(args, prep, None, tok)
        assert res["accuracy"] == want and res["total"] == 12, (mode, res)
        assert sorted(res["groups"]) == ["essays 200 tokens", "essays 300 tokens",
                                         "zh_notes 200 tokens", "zh_notes 300 tokens"]  # fmt: skip
        json.dumps(res)  # --output-json writes it
