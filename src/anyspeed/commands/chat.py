"""``anyspeed generate --task chat``: turns read from stdin (rank 0, shared with every rank),
the answer streamed to the terminal token by token, the last ``--history-turns`` exchanges
kept in the prompt."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def read_turn() -> str | None:
    """The next user line on rank 0 (None at EOF or "exit"), the same on every rank; a line
    that is not UTF-8 is refused in one line and read again."""
    import torch.distributed as dist

    box: list[str | None] = [None]
    if int(os.environ.get("RANK", "0")) == 0:
        while True:
            print("\nYou >> ", end="", flush=True)
            raw = sys.stdin.buffer.readline()
            try:
                line = raw.decode("utf-8")
                break
            except UnicodeDecodeError as exc:
                print(
                    f"(stdin: that line is not UTF-8 text, byte 0x{raw[exc.start]:02x} at "
                    f"offset {exc.start}; type it again)",
                    flush=True,
                )
        box[0] = None if not line or line.strip() in ("exit", "quit") else line.rstrip("\n")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


class _Stream:
    """Prints the decoded text of row 0 as it grows (on rank 0)."""

    def __init__(self, tok: Any, eos: tuple[int, ...]) -> None:
        self.tok, self.eos, self.ids, self.shown = tok, eos, [], ""
        self.on = int(os.environ.get("RANK", "0")) == 0

    def __call__(self, tokens: list[int | None]) -> None:
        from anyspeed.commands.prompting import text_of

        tok = tokens[0]
        if tok is None or not self.on:
            return
        self.ids.append(tok)
        text = text_of(self.tok, self.ids, self.eos)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[len(self.shown) :], end="", flush=True)
            self.shown = text


def chat(args: argparse.Namespace, model: list, tok: Any) -> None:
    """Read, answer, repeat until EOF or "exit"."""
    from anyspeed.commands.prompting import prompts, request, text_of
    from anyspeed.inference.decode import generate

    req = request(args, tok)
    history: list[dict] = []
    special = not (args.hf_chat_template or args.prompt_type)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    given = iter(prompts(args))  # --prompt / --prompts-file: the turns, else stdin
    scripted = bool(args.prompt or args.prompts_file)
    while (line := next(given, None) if scripted else read_turn()) is not None:
        if scripted and rank0:
            print(f"\nYou >> {line}")
        history, ids = _fit(args, tok, history, line, special)
        if ids is None:
            continue
        if int(os.environ.get("RANK", "0")) == 0:
            print("anyspeed >> ", end="", flush=True)
        out = generate(model, [ids], req, on_tokens=_Stream(tok, req.eos_ids))[0]
        if int(os.environ.get("RANK", "0")) == 0:
            print(flush=True)
        history += [
            {"role": "user", "content": line},
            {"role": "assistant", "content": text_of(tok, out, req.eos_ids)},
        ]


def _fit(
    args: argparse.Namespace, tok: Any, history: list[dict], line: str, special: bool
) -> tuple[list[dict], list[int] | None]:
    """The history kept (the last ``--history-turns`` exchanges, the oldest dropped until the
    new turn fits the context) and the prompt's ids; None when the turn alone does not fit."""
    from anyspeed.commands.prompting import render

    keep = history[len(history) - 2 * args.history_turns :] if args.history_turns else []
    while True:
        messages = [*keep, {"role": "user", "content": line}]
        ids = tok.encode([render(args, tok, messages)], special=special)[0]
        if len(ids) < args.max_length:
            return keep, ids
        if not keep:
            if int(os.environ.get("RANK", "0")) == 0:
                print(
                    f"(this turn is {len(ids)} tokens, over the context of "
                    f"{args.max_length} (--max-length); say it shorter)"
                )
            return keep, None
        keep = keep[2:]  # drop the oldest exchange
