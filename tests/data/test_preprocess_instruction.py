"""Instruction handlers: prompt tokens labelled -100, responses kept; packing never splits."""

from __future__ import annotations

import json
import random

import pytest

from helpers.corpora import (
    make_docs,
    read_back,
    run_cli,
    write_jsonl,
)

IGNORE = -100
WORDS = make_docs(60, seed=11)


def _reference(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """input_ids/labels from the tokenizer's own template: each assistant turn is the response."""
    ids: list[int] = []
    labels: list[int] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        p = tok(prompt[len(done) :], add_special_tokens=False)["input_ids"]
        r = tok(full[len(prompt) :], add_special_tokens=False)["input_ids"]
        ids += p + r
        labels += [IGNORE] * len(p) + r
        done = full
    return ids, labels


def _run(capsys, tmp_path, hf_tok, src, *flags) -> tuple[str, str]:
    prefix = str(tmp_path / "sft")
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix", prefix,
                      "--tokenizer-name-or-path", hf_tok, *flags)  # fmt: skip
    assert rc == 0, err
    return prefix, err


def _load(prefix: str) -> tuple[list, list, list]:
    return tuple(
        read_back(f"{prefix}_packed_{k}_document")
        for k in ("input_ids", "attention_mask", "labels")
    )


def test_alpaca_labels_mask_exactly_the_prompt(tmp_path, capsys, hf_tok, auto_tok):
    recs = [
        {"instruction": WORDS[i], "input": WORDS[i + 1] if i % 2 else "", "output": WORDS[i + 2]}
        for i in range(0, 30, 3)
    ]
    src = write_jsonl(str(tmp_path / "a.jsonl"), recs)
    prefix, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name",
                     "AlpacaStyleInstructionHandler", "--workers", "2")  # fmt: skip
    ids, mask, labels = _load(prefix)
    assert len(ids) == len(recs)
    for rec, i, m, lab in zip(recs, ids, mask, labels, strict=True):
        user = rec["instruction"] + ("\n" + rec["input"] if rec["input"] else "")
        # Independently written ChatML text: prompt and response rendered by hand.
        prompt = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        response = f"{rec['output']}<|im_end|>\n"
        p = auto_tok(prompt, add_special_tokens=False)["input_ids"]
        r = auto_tok(response, add_special_tokens=False)["input_ids"]
        assert i == p + r
        assert lab == [IGNORE] * len(p) + r
        assert m == [1] * len(i)


def test_sharegpt_multi_turn_and_custom_map_keys(tmp_path, capsys, hf_tok, auto_tok):
    recs = []
    for k in range(6):
        turns = [
            {"speaker": "person" if j % 2 == 0 else "bot", "text": WORDS[k + j]} for j in range(4)
        ]
        recs.append({"dialog": turns, "sys": "be brief" if k % 2 else None})
    src = write_jsonl(str(tmp_path / "s.jsonl"), recs)
    keys = {"messages": "dialog", "system": "sys",
            "tags": {"role_tag": "speaker", "content_tag": "text",
                     "user_tag": "person", "assistant_tag": "bot"}}  # fmt: skip
    prefix, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name",
                     "SharegptStyleInstructionHandler", "--map-keys", json.dumps(keys))  # fmt: skip
    ids, _, labels = _load(prefix)
    for rec, i, lab in zip(recs, ids, labels, strict=True):
        msgs = [{"role": "system", "content": rec["sys"]}] if rec["sys"] else []
        msgs += [
            {"role": "user" if t["speaker"] == "person" else "assistant", "content": t["text"]}
            for t in rec["dialog"]
        ]
        assert (i, lab) == _reference(auto_tok, msgs)
        # The learned tokens decode to exactly the two assistant replies (+ end markers).
        learned = auto_tok.decode([t for t, la in zip(i, lab, strict=True) if la != IGNORE])
        assert learned == "".join(f"{t['text']}<|im_end|>\n" for t in rec["dialog"][1::2])


def test_openai_messages_with_builtin_prompt_type_and_eod(tmp_path, capsys, hf_tok, auto_tok):
    recs = [
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": WORDS[k]},
                      {"role": "assistant", "content": WORDS[k + 1]}]}
        for k in range(5)
    ]  # fmt: skip
    src = write_jsonl(str(tmp_path / "o.jsonl"), recs)
    prefix, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name",
                     "OpenAIStyleInstructionHandler", "--prompt-type", "alpaca")  # fmt: skip
    ids, _, labels = _load(prefix)
    eos = auto_tok.eos_token_id
    for rec, i, lab in zip(recs, ids, labels, strict=True):
        _, user, bot = (m["content"] for m in rec["messages"])
        prompt = f"sys\n\n### Instruction:\n{user}\n\n### Response:\n"
        p = auto_tok(prompt, add_special_tokens=False)["input_ids"]
        r = auto_tok(bot, add_special_tokens=False)["input_ids"] + [eos]
        assert i == p + r and lab == [IGNORE] * len(p) + r


def _samples(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = " ".join(WORDS).split()
    out = []
    for k in range(n):
        q = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        a = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        out.append({"instruction": f"{q} q{k}", "output": f"{a} a{k}"})
    return out


@pytest.mark.parametrize("workers", ["1", "2"])
def test_pack_never_splits_a_sample(tmp_path, capsys, hf_tok, auto_tok, workers):
    recs = _samples(80, seed=5)
    recs.append({"instruction": " ".join(WORDS), "output": "too long"})  # exceeds --seq-length
    src = write_jsonl(str(tmp_path / "p.jsonl"), recs)
    seq = 128
    prefix, err = _run(capsys, tmp_path, hf_tok, src, "--handler-name",
                       "AlpacaStyleInstructionHandler", "--pack", "--neat-pack",
                       "--seq-length", str(seq), "--pack-window", "50",
                       "--workers", workers)  # fmt: skip
    assert "longer than --seq-length: 1" in err
    ids, seg, labels = _load(prefix)
    expected = {}
    for rec in recs[:-1]:
        msgs = [{"role": "user", "content": rec["instruction"]},
                {"role": "assistant", "content": rec["output"]}]  # fmt: skip
        i, lab = _reference(auto_tok, msgs)
        expected[tuple(i)] = tuple(lab)
    found = []
    for pi, ps, pl in zip(ids, seg, labels, strict=True):
        assert len(pi) == len(ps) == len(pl) == seq
        n_segments = max(ps)
        assert sorted(set(ps) - {0}) == list(range(1, n_segments + 1))
        real = [s for s in ps if s]
        assert real == sorted(real) and all(s == 0 for s in ps[len(real) :])  # pad at the end
        assert all(la == IGNORE for la in pl[len(real) :])
        for s in range(1, n_segments + 1):
            span = [k for k, v in enumerate(ps) if v == s]
            sample = tuple(pi[span[0] : span[-1] + 1])
            assert sample in expected, "a packed segment is not one whole sample"
            assert tuple(pl[span[0] : span[-1] + 1]) == expected[sample]
            found.append(sample)
    assert sorted(found) == sorted(expected)  # every sample exactly once


def test_plain_pack_pads_and_fills(tmp_path, capsys, hf_tok, auto_tok):
    from anyspeed.data.packing import plan_bins

    lengths = [random.Random(3).randint(1, 100) for _ in range(500)]
    bins = plan_bins(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert len(bins) <= int(1.25 * sum(lengths) / 100) + 2  # greedy is near the lower bound

    src = write_jsonl(str(tmp_path / "p.jsonl"), _samples(40, seed=9))
    prefix, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name",
                     "AlpacaStyleInstructionHandler", "--pack", "--seq-length", "96")  # fmt: skip
    ids, mask, labels = _load(prefix)
    pad = auto_tok.pad_token_id
    for i, m, lab in zip(ids, mask, labels, strict=True):
        real = sum(m)
        assert m == [1] * real + [0] * (96 - real)
        assert i[real:] == [pad] * (96 - real) and lab[real:] == [IGNORE] * (96 - real)


@pytest.mark.parametrize("thinking", ["true", "false", "None"])
def test_mindspeed_enable_thinking(tmp_path, capsys, hf_tok, auto_tok, thinking):
    """MindSpeed-LLM's data_convert flags, as its Qwen3 script passes them: ``--enable-thinking
    true`` opens the response with the empty thinking block (trained on), ``false`` or
    ``none`` closes the prompt with it (MindSpeed-LLM's reasoning template: not thinking unless
    true); ``--log-interval`` and ``--overwrite-cache`` are accepted."""
    recs = [{"instruction": WORDS[i], "input": "", "output": WORDS[i + 1]} for i in range(0, 8, 2)]
    src = write_jsonl(str(tmp_path / "a.jsonl"), recs)
    prefix, _ = _run(capsys, tmp_path, hf_tok, src, "--handler-name",
                     "AlpacaStyleInstructionHandler", "--prompt-type", "qwen3", "--enable-thinking",
                     thinking, "--log-interval", "1000", "--overwrite-cache")  # fmt: skip
    ids, _, labels = _load(prefix)
    think = "<think>\n\n</think>\n\n"  # written by hand, as Qwen3 renders the empty block
    for rec, i, lab in zip(recs, ids, labels, strict=True):
        prompt = f"<|im_start|>user\n{rec['instruction']}<|im_end|>\n<|im_start|>assistant\n"
        response = f"{rec['output']}<|im_end|>\n"
        if thinking == "true":
            response = think + response
        else:
            prompt += think
        p = auto_tok(prompt, add_special_tokens=False)["input_ids"]
        r = auto_tok(response, add_special_tokens=False)["input_ids"]
        assert i == p + r and lab == [IGNORE] * len(p) + r


def test_enable_thinking_needs_qwen3(tmp_path, capsys, hf_tok):
    src = write_jsonl(str(tmp_path / "a.jsonl"), [{"instruction": "a", "output": "b"}])
    rc, err = run_cli(capsys, "preprocess", "--input", src, "--output-prefix",
                      str(tmp_path / "x"), "--tokenizer-name-or-path", hf_tok, "--handler-name",
                      "AlpacaStyleInstructionHandler", "--prompt-type", "qwen", "--enable-thinking",
                      "true")  # fmt: skip
    assert rc == 2 and "--enable-thinking applies to --prompt-type qwen3" in err
    assert len(err.strip().splitlines()) == 1
