"""Pairwise (DPO) handlers: chosen and rejected share the prompt; only the answer is learned."""

from __future__ import annotations

import json
import os

import pytest

from helpers.corpora import leftovers, make_docs, read_back, run_cli, write_jsonl
from helpers.instruction import chat_prompt_ids

IGNORE = -100
WORDS = make_docs(40, seed=23)
KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
ALPACA_SYSTEM = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request."
)


def _run(capsys, tmp_path, hf_tok, src, *flags) -> tuple[str, str]:
    prefix = str(tmp_path / "dpo")
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix", prefix,
                      "--tokenizer-name-or-path", hf_tok, *flags)  # fmt: skip
    assert rc == 0, err
    return prefix, err


def _load(prefix: str) -> dict[str, list[list[int]]]:
    for k in KEYS:
        for ext in ("bin", "idx"):
            assert os.path.exists(f"{prefix}_packed_{k}_document.{ext}")
    return {k: read_back(f"{prefix}_packed_{k}_document") for k in KEYS}


def _enc(auto_tok, text: str) -> list[int]:
    return auto_tok(text, add_special_tokens=False)["input_ids"]


def _check_pair(out: dict, n: int, prompt: list[int], chosen: list[int], rejected: list[int]):
    """Sample n is prompt + answer for both; labels are -100 exactly on the prompt."""
    for key, answer in (("chosen", chosen), ("rejected", rejected)):
        assert out[f"{key}_input_ids"][n] == prompt + answer
        assert out[f"{key}_labels"][n] == [IGNORE] * len(prompt) + answer


def test_alpaca_pairwise_with_prompt_type(tmp_path, capsys, hf_tok, auto_tok):
    recs = [
        {"instruction": WORDS[k], "input": WORDS[k + 1] if k % 2 else "",
         "chosen": WORDS[k + 2], "rejected": WORDS[k + 3]}
        for k in range(6)
    ]  # fmt: skip
    src = write_jsonl(str(tmp_path / "a.jsonl"), recs)
    prefix, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name",
                     "AlpacaStylePairwiseHandler", "--prompt-type", "alpaca")  # fmt: skip
    out = _load(prefix)
    assert all(len(v) == len(recs) for v in out.values())
    eos = auto_tok.eos_token_id
    for n, rec in enumerate(recs):
        user = rec["instruction"] + ("\n" + rec["input"] if rec["input"] else "")
        # The alpaca template written out by hand; it ends every response with EOS.
        prompt = _enc(auto_tok, f"{ALPACA_SYSTEM}\n\n### Instruction:\n{user}\n\n### Response:\n")
        chosen = _enc(auto_tok, rec["chosen"]) + [eos]
        rejected = _enc(auto_tok, rec["rejected"]) + [eos]
        _check_pair(out, n, prompt, chosen, rejected)
        assert (
            out["chosen_input_ids"][n][: len(prompt)] == out["rejected_input_ids"][n][: len(prompt)]
        )


def test_history_answers_are_not_learned(tmp_path, capsys, hf_tok, auto_tok):
    history = [[WORDS[0], WORDS[1]], [WORDS[2], WORDS[3]]]
    rec = {"instruction": WORDS[4], "chosen": WORDS[5], "rejected": WORDS[6],
           "system": "be brief", "history": history}  # fmt: skip
    src = write_jsonl(str(tmp_path / "h.jsonl"), [rec])
    prefix, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name",
                     "AlpacaStylePairwiseHandler", "--prompt-type", "chatml",
                     "--append-eod")  # fmt: skip
    out = _load(prefix)
    # ChatML by hand, one piece per prompt/response segment (as the instruction handler encodes).
    pieces = [
        "<|im_start|>system\nbe brief<|im_end|>\n"
        f"<|im_start|>user\n{WORDS[0]}<|im_end|>\n<|im_start|>assistant\n",
        f"{WORDS[1]}<|im_end|>\n",
        f"<|im_start|>user\n{WORDS[2]}<|im_end|>\n<|im_start|>assistant\n",
        f"{WORDS[3]}<|im_end|>\n",
        f"<|im_start|>user\n{WORDS[4]}<|im_end|>\n<|im_start|>assistant\n",
    ]
    prompt = [t for p in pieces for t in _enc(auto_tok, p)]
    eos = auto_tok.eos_token_id
    chosen = _enc(auto_tok, f"{WORDS[5]}<|im_end|>\n") + [eos]  # --append-eod
    rejected = _enc(auto_tok, f"{WORDS[6]}<|im_end|>\n") + [eos]
    _check_pair(out, 0, prompt, chosen, rejected)
    learned = [t for t, la in zip(*(out[k][0] for k in KEYS[:2]), strict=True) if la != IGNORE]
    assert auto_tok.decode(learned[:-1]) == f"{WORDS[5]}<|im_end|>\n"  # no history answer


def test_sharegpt_dict_and_string_answers_with_map_keys(tmp_path, capsys, hf_tok, auto_tok):
    recs = []
    for k in range(4):
        turns = [{"speaker": "person", "text": WORDS[k]}, {"speaker": "bot", "text": WORDS[k + 1]},
                 {"speaker": "person", "text": WORDS[k + 2]}]  # fmt: skip
        good = {"speaker": "bot", "text": WORDS[k + 3]} if k % 2 else WORDS[k + 3]
        recs.append({"dialog": turns, "good": good, "bad": WORDS[k + 4], "sys": "sys"})
    src = write_jsonl(str(tmp_path / "s.jsonl"), recs)
    keys = {"messages": "dialog", "system": "sys", "chosen": "good", "rejected": "bad",
            "tags": {"role_tag": "speaker", "content_tag": "text",
                     "user_tag": "person", "assistant_tag": "bot"}}  # fmt: skip
    prefix, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name",
                     "SharegptStylePairwiseHandler", "--map-keys", json.dumps(keys),
                     "--prompt-type", "default")  # fmt: skip
    out = _load(prefix)
    eos = auto_tok.eos_token_id
    for n, rec in enumerate(recs):
        t = [x["text"] for x in rec["dialog"]]
        good = rec["good"]["text"] if isinstance(rec["good"], dict) else rec["good"]
        # The "default" template by hand: EOS after every response, history ones included.
        prompt = (_enc(auto_tok, f"System: sys\nHuman: {t[0]}\nAssistant: ")
                  + _enc(auto_tok, t[1]) + [eos]
                  + _enc(auto_tok, f"Human: {t[2]}\nAssistant: "))  # fmt: skip
        chosen, rejected = _enc(auto_tok, good) + [eos], _enc(auto_tok, rec["bad"]) + [eos]
        _check_pair(out, n, prompt, chosen, rejected)


def test_bad_records_are_skipped_and_counted(tmp_path, capsys, hf_tok):
    ok = {"instruction": "q", "chosen": "yes", "rejected": "no"}
    recs = [
        ok,
        {"instruction": "q", "chosen": "yes"},  # no rejected
        {"instruction": "q", "chosen": "", "rejected": "no"},  # empty chosen
        {"instruction": "q", "chosen": 3, "rejected": "no"},  # not a string
        {"instruction": "q", "chosen": "yes " * 200, "rejected": "no"},  # chosen too long
        {"instruction": "q", "chosen": "yes", "rejected": "yes"},  # nothing to prefer
        ok,
    ]
    src = write_jsonl(str(tmp_path / "b.jsonl"), recs)
    prefix, err = _run(capsys, tmp_path, hf_tok, src, "--handler-name",
                       "AlpacaStylePairwiseHandler", "--prompt-type", "chatml",
                       "--seq-length", "64")  # fmt: skip
    assert "7 documents read, 2 written" in err
    assert "skipped 5" in err
    for reason in ("missing key: 1", "empty answer: 1", "not a string: 1",
                   "longer than --seq-length: 1",
                   "identical chosen and rejected answers: 1"):  # fmt: skip
        assert reason in err
    assert "b.jsonl:2: missing key ('rejected')" in err
    assert "b.jsonl:3: empty answer ('chosen')" in err
    out = _load(prefix)
    assert all(len(v) == 2 for v in out.values())

    # A sharegpt prompt must end with a user turn.
    bad = {
        "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
        "chosen": {"from": "gpt", "value": "y"},
        "rejected": {"from": "gpt", "value": "n"},
    }
    good = {**bad, "conversations": bad["conversations"][:1]}  # fmt: skip
    src = write_jsonl(str(tmp_path / "c.jsonl"), [bad, good])
    _, err = _run(capsys, tmp_path, hf_tok, src, "--handler-name", "SharegptStylePairwiseHandler",
                  "--prompt-type", "chatml", "--overwrite")  # fmt: skip
    assert "2 documents read, 1 written" in err
    assert "prompt does not end with a user turn: 1" in err


@pytest.mark.parametrize("flag", ["--pack", "--neat-pack"])
def test_pack_is_refused_before_any_work(tmp_path, capsys, hf_tok, flag):
    src = write_jsonl(str(tmp_path / "p.jsonl"), [{"instruction": "q", "chosen": "y",
                                                   "rejected": "n"}])  # fmt: skip
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix", str(out / "d"),
                      "--tokenizer-name-or-path", hf_tok, "--handler-name",
                      "AlpacaStylePairwiseHandler", "--prompt-type", "chatml",
                      "--seq-length", "64", flag)  # fmt: skip
    assert rc == 2
    assert "pairwise data is not packed; drop --pack" in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists() or leftovers(str(out)) == []


def test_tokenizer_chat_template(tmp_path, capsys, hf_tok, auto_tok):
    if not auto_tok.chat_template:
        pytest.skip("the test tokenizer has no chat template")
    rec = {"instruction": WORDS[7], "chosen": WORDS[8], "rejected": WORDS[9],
           "history": [[WORDS[10], WORDS[11]]]}  # fmt: skip
    src = write_jsonl(str(tmp_path / "t.jsonl"), [rec])
    prefix, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name", "AlpacaStylePairwiseHandler")
    out = _load(prefix)
    history = [{"role": "user", "content": WORDS[10]}, {"role": "assistant", "content": WORDS[11]}]
    prompt, msgs = chat_prompt_ids(auto_tok, history, WORDS[7], lambda t: _enc(auto_tok, t))

    def render(m, gen):
        return auto_tok.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)

    answers = []
    for a in (rec["chosen"], rec["rejected"]):
        full = render([*msgs, {"role": "assistant", "content": a}], False)
        answers.append(_enc(auto_tok, full[len(render(msgs, True)) :]))
    _check_pair(out, 0, prompt, *answers)
