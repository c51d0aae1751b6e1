"""``anyspeed generate --task chat``: turns read from stdin (rank 0, shared with every rank),
the answer streamed to the terminal token by token, the last ``--history-turns`` exchanges
kept in the prompt."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def _read_turn() -> str | None:
    """The next user line on rank 0 (None at EOF or "exit"), the same on every rank."""
    import torch.distributed as dist

    box: list[str | None] = [None]
    if int(os.environ.get("RANK", "0")) == 0:
        print("\nYou >> ", end="", flush=True)
        line = sys.stdin.readline()
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
    from anyspeed.commands.prompting import render, request, text_of
    from anyspeed.inference.decode import generate

    req = request(args, tok)
    history: list[dict] = []
    special = not (args.hf_chat_template or args.prompt_type)
    while (line := _read_turn()) is not None:
        keep = history[len(history) - 2 * args.history_turns :] if args.history_turns else []
        messages = [*keep, {"role": "user", "content": line}]
        ids = tok.encode([render(args, tok, messages)], special=special)[0]
        if len(ids) >= args.max_length:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"(the conversation is {len(ids)} tokens, over the context of "
                      f"{args.max_length}; history cleared)")  # fmt: skip
            history = []
            continue
        if int(os.environ.get("RANK", "0")) == 0:
            print("anyspeed >> ", end="", flush=True)
        out = generate(model, [ids], req, on_tokens=_Stream(tok, req.eos_ids))[0]
        if int(os.environ.get("RANK", "0")) == 0:
            print(flush=True)
        history += [{"role": "user", "content": line},
                    {"role": "assistant", "content": text_of(tok, out, req.eos_ids)}]  # fmt: skip
