"""Prompts for reinforcement learning (R1AlpacaStyleInstructionHandler): the prompt up to the
open answer in ``input_ids``, the reference answer's own tokens in ``labels``."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers.corpora import dataset_dtype, leftovers, make_docs, read_back, run_cli, write_jsonl
from helpers.instruction import chat_prompt_ids

IGNORE = -100
WORDS = make_docs(40, seed=31)
KEYS = ("input_ids", "attention_mask", "labels")
HANDLER = "R1AlpacaStyleInstructionHandler"
QWEN_SYSTEM = "You are a helpful assistant."


def _run(capsys, tmp_path, hf_tok, src, *flags, name="rl") -> tuple[str, str]:
    prefix = str(tmp_path / name)
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix", prefix,
                      "--tokenizer-name-or-path", hf_tok, *flags)  # fmt: skip
    assert rc == 0, err
    return prefix, err


def _load(prefix: str) -> dict[str, list[list[int]]]:
    for k in KEYS:
        for ext in ("bin", "idx"):
            assert os.path.exists(f"{prefix}_packed_{k}_document.{ext}")
    out = {k: read_back(f"{prefix}_packed_{k}_document") for k in KEYS}
    for ids, mask in zip(out["input_ids"], out["attention_mask"], strict=True):
        assert mask == [1] * len(ids)
    assert all(IGNORE not in labels for labels in out["labels"])
    return out


def _enc(auto_tok, text: str) -> list[int]:
    return auto_tok(text, add_special_tokens=False)["input_ids"]


def test_alpaca_qwen_prompt_and_answer(tmp_path, capsys, hf_tok, auto_tok):
    recs = [
        {"instruction": WORDS[k], "input": WORDS[k + 1] if k % 2 else "", "output": WORDS[k + 2]}
        for k in range(6)
    ]
    recs.append({"instruction": WORDS[20], "output": WORDS[21], "system": "be brief",
                 "history": [[WORDS[22], WORDS[23]]]})  # fmt: skip
    src = write_jsonl(str(tmp_path / "a.jsonl"), recs)
    prefix, err = _run(capsys, tmp_path, hf_tok, src, "--handler-name", HANDLER,
                       "--prompt-type", "qwen")  # fmt: skip
    assert f"{len(recs)} documents read, {len(recs)} written" in err
    out = _load(prefix)
    assert dataset_dtype(f"{prefix}_packed_labels_document") == np.int32
    assert dataset_dtype(f"{prefix}_packed_attention_mask_document") == np.uint8
    for n, rec in enumerate(recs[:-1]):
        user = rec["instruction"] + ("\n" + rec["input"] if rec["input"] else "")
        # The qwen template by hand: default system, the user turn, the open assistant turn.
        text = (
            f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        )
        prompt = _enc(auto_tok, text)
        assert out["input_ids"][n] == prompt
        assert out["labels"][n] == _enc(auto_tok, rec["output"])
    # History: one piece per prompt/response segment, as the instruction handler encodes them.
    pieces = [
        "<|im_start|>system\nbe brief<|im_end|>\n"
        f"<|im_start|>user\n{WORDS[22]}<|im_end|>\n<|im_start|>assistant\n",
        f"{WORDS[23]}<|im_end|>\n",
        f"<|im_start|>user\n{WORDS[20]}<|im_end|>\n<|im_start|>assistant\n",
    ]
    assert out["input_ids"][-1] == [t for p in pieces for t in _enc(auto_tok, p)]
    assert out["labels"][-1] == _enc(auto_tok, WORDS[21])

    # The SFT handler's rendering of the same records starts with exactly these prompt ids:
    # everything before its first learned label (single-turn records: history answers are learned).
    sft, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name",
                  "AlpacaStyleInstructionHandler", "--prompt-type", "qwen", name="sft")  # fmt: skip
    sft_ids = read_back(f"{sft}_packed_input_ids_document")
    sft_labels = read_back(f"{sft}_packed_labels_document")
    for n in range(len(recs) - 1):
        first = next(i for i, la in enumerate(sft_labels[n]) if la != IGNORE)
        assert sft_ids[n][:first] == out["input_ids"][n]
        assert sft_ids[n][first:][: len(out["labels"][n])] == out["labels"][n]
    assert sft_ids[-1][: len(out["input_ids"][-1])] == out["input_ids"][-1]


def test_gsm8k_records_with_map_keys(tmp_path, capsys, hf_tok, auto_tok):
    recs = [
        {"question": f"{WORDS[k]}?", "answer": f"{WORDS[k + 1]}\n<<6*7={42 + k}>>\n#### {42 + k}"}
        for k in range(5)
    ]
    src = write_jsonl(str(tmp_path / "gsm8k.jsonl"), recs)
    prefix, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name", HANDLER, "--map-keys",
                     json.dumps({"prompt": "question", "response": "answer"}),
                     "--prompt-type", "chatml")  # fmt: skip
    out = _load(prefix)
    for n, rec in enumerate(recs):
        prompt = f"<|im_start|>user\n{rec['question']}<|im_end|>\n<|im_start|>assistant\n"
        assert out["input_ids"][n] == _enc(auto_tok, prompt)
        assert out["labels"][n] == _enc(auto_tok, rec["answer"])
        text = auto_tok.decode(out["labels"][n], clean_up_tokenization_spaces=False)
        assert text == rec["answer"]
        assert text.rsplit("#### ", 1)[1] == str(42 + n)


def test_bad_records_are_skipped_and_counted(tmp_path, capsys, hf_tok):
    ok = {"instruction": "q", "output": "a"}
    recs = [
        ok,
        {"instruction": "q"},  # no response
        {"instruction": "q", "output": None},  # no response
        {"instruction": "q", "output": ""},  # empty response
        {"instruction": "q", "output": 7},  # not a string
        {"instruction": " ", "output": "a"},  # empty prompt
        {"instruction": "q " * 200, "output": "a"},  # prompt longer than --seq-length
        ok,
    ]
    src = write_jsonl(str(tmp_path / "b.jsonl"), recs)
    prefix, err = _run(capsys, tmp_path, hf_tok, src, "--handler-name", HANDLER,
                       "--prompt-type", "chatml", "--seq-length", "64")  # fmt: skip
    assert "8 documents read, 2 written" in err
    assert "skipped 6" in err
    for reason in ("missing key: 2", "empty answer: 1", "not a string: 1", "empty prompt: 1",
                   "longer than --seq-length: 1"):  # fmt: skip
        assert reason in err
    assert "b.jsonl:2: missing key ('output')" in err
    assert "b.jsonl:4: empty answer ('output')" in err
    out = _load(prefix)
    assert all(len(v) == 2 for v in out.values())
    assert out["input_ids"][0] == out["input_ids"][1]


@pytest.mark.parametrize("flag", ["--pack", "--neat-pack"])
def test_pack_is_refused_before_any_work(tmp_path, capsys, hf_tok, flag):
    src = write_jsonl(str(tmp_path / "p.jsonl"), [{"instruction": "q", "output": "a"}])
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix", str(out / "d"),
                      "--tokenizer-name-or-path", hf_tok, "--handler-name", HANDLER,
                      "--prompt-type", "chatml", "--seq-length", "64", flag)  # fmt: skip
    assert rc == 2
    assert "prompts for reinforcement learning are not packed; drop --pack" in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists() or leftovers(str(out)) == []


def test_append_eod_is_refused(tmp_path, capsys, hf_tok):
    src = write_jsonl(str(tmp_path / "e.jsonl"), [{"instruction": "q", "output": "a"}])
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix",
                      str(tmp_path / "e"), "--tokenizer-name-or-path", hf_tok,
                      "--handler-name", HANDLER, "--prompt-type", "chatml",
                      "--append-eod")  # fmt: skip
    assert rc == 2
    assert "--append-eod does not apply" in err
    assert leftovers(str(tmp_path)) == ["e.jsonl"]


def test_tokenizer_chat_template(tmp_path, capsys, hf_tok, auto_tok):
    if not auto_tok.chat_template:
        pytest.skip("the test tokenizer has no chat template")
    rec = {"instruction": WORDS[7], "output": WORDS[8], "history": [[WORDS[10], WORDS[11]]]}
    src = write_jsonl(str(tmp_path / "t.jsonl"), [rec, {"instruction": WORDS[9], "output": "x"}])
    prefix, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name", HANDLER)
    out = _load(prefix)
    history = [{"role": "user", "content": WORDS[10]}, {"role": "assistant", "content": WORDS[11]}]
    prompt, msgs = chat_prompt_ids(auto_tok, history, WORDS[7], lambda t: _enc(auto_tok, t))

    def render(m, gen):
        return auto_tok.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)

    assert out["input_ids"][0] == prompt
    assert out["labels"][0] == _enc(auto_tok, WORDS[8])
    single = render([{"role": "user", "content": WORDS[9]}], True)
    assert out["input_ids"][1] == _enc(auto_tok, single)
    assert out["labels"][1] == _enc(auto_tok, "x")
