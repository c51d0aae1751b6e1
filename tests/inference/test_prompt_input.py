"""Prompts and chat turns as a user gives them: text that is not UTF-8 is one line naming the
flag or file (never a traceback), ``--task chat --prompt`` answers the prompt instead of
waiting for stdin, and a chat whose history overflows the context drops its oldest exchanges
and answers the new turn (the turn alone too long: one line, and the chat goes on)."""

from __future__ import annotations

import argparse
import io
import os

import pytest

from anyspeed.commands import chat
from anyspeed.commands.prompting import prompts
from anyspeed.errors import UsageError


def _args(**kw) -> argparse.Namespace:
    base = dict(prompt=[], prompts_file=None, history_turns=8, max_length=40,
                hf_chat_template=False, prompt_type=None)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_prompt_not_utf8_is_one_line():
    text = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # as Python decodes argv
    with pytest.raises(UsageError, match=r"^--prompt 'caf.*': not UTF-8 text \(byte 0xe9\)"):
        prompts(_args(prompt=[text]))


def test_prompts_file_not_utf8_names_the_file(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"fine\n\xff\xfe broken\n")
    with pytest.raises(UsageError, match=rf"--prompts-file '{f}': not UTF-8 text \(byte 0xff"):
        prompts(_args(prompts_file=str(f)))
    f.write_text("one\n\ntwo\n")
    assert prompts(_args(prompt=["zero"], prompts_file=str(f))) == ["zero", "one", "two"]


def test_chat_stdin_not_utf8_is_refused_and_read_again(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff bad\nhello\n")))
    monkeypatch.delenv("RANK", raising=False)
    assert chat.read_turn() == "hello"
    assert "(stdin: that line is not UTF-8 text, byte 0xff at offset 0" in capsys.readouterr().out


class _Tok:
    """One token per character of the rendered conversation (render: the turns joined)."""

    def encode(self, texts, special=True):
        return [[0] * len(t) for t in texts]


def _render(args, tok, messages):
    return "|".join(m["content"] for m in messages)


def test_chat_history_overflow_drops_the_oldest_turns(monkeypatch, capsys):
    monkeypatch.setattr("anyspeed.commands.prompting.render", _render)
    history = []
    for i in range(3):  # three 10-character exchanges: 60 characters of history
        history += [{"role": "user", "content": f"question{i}"},
                    {"role": "assistant", "content": f"answer{i:03d}"}]  # fmt: skip
    keep, ids = chat._fit(_args(), _Tok(), history, "new turn", special=True)
    assert keep == history[4:]  # the two oldest exchanges went; the newest stays
    assert ids is not None and len(ids) < 40
    keep, ids = chat._fit(_args(), _Tok(), history, "x" * 50, special=True)
    assert ids is None and "over the context of 40" in capsys.readouterr().out


def test_chat_with_prompt_answers_it_without_stdin(monkeypatch):
    """``--task chat --prompt TEXT``: the prompts are the turns; stdin is never read."""
    seen = []

    def fake_generate(model, prompts_ids, req, on_tokens=None):
        seen.append(prompts_ids)
        return [[1, 2]]

    monkeypatch.setattr("anyspeed.inference.decode.generate", fake_generate)
    monkeypatch.setattr("anyspeed.commands.prompting.render", _render)
    monkeypatch.setattr("anyspeed.commands.prompting.request", lambda a, t: argparse.Namespace(
        eos_ids=()))  # fmt: skip
    monkeypatch.setattr("anyspeed.commands.prompting.text_of", lambda tok, ids, eos: "ok")
    monkeypatch.setattr("sys.stdin", None)  # reading it would fail
    monkeypatch.setitem(os.environ, "RANK", "1")  # no printing
    chat.chat(_args(prompt=["first", "second"]), [], _Tok())
    assert [len(p[0]) for p in seen] == [len("first"), len("first|ok|second")]


def test_models_takes_no_flags(capsys):
    from anyspeed.cli import main

    assert main(["models", "--bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "anyspeed models: error: unrecognized arguments: --bogus (it takes no flags)"
