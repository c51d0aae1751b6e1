"""``anyspeed generate``: text from a Megatron checkpoint (any saved layout) or an HF directory.

MindSpeed-LLM's inference flags: ``--task`` (greedy, do_sample, beam_search,
beam_search_with_sampling, chat), ``--max-new-tokens``, ``--temperature``, ``--top-k``,
``--top-p``, ``--hf-chat-template`` or ``--prompt-type``, ``--history-turns``,
``--use-kv-cache`` (on by default here), ``--seed``; and ``--stop`` strings.
Prompts come from ``--prompt`` (repeatable) or ``--prompts-file`` (one per line) and run as one
left-padded batch; ``chat`` reads turns from stdin and streams the answer. TP x PP ranks are
started with torchrun (``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``).

A LLaVA model (a ``vlm`` checkpoint, a converted one, or an HF LLaVA directory: its record
says which) describes or answers about ``--image`` files (repeatable), greedily, one row per
image, at any tensor-parallel size; the prompt (default "what is in the picture?") is rendered
as the ``vlm`` stage trains: ``USER: <image>\\n{prompt}\\nASSISTANT: ``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from anyspeed.commands import image, runner, session
from anyspeed.commands.prompting import prompts, render, request, sampling_params, text_of
from anyspeed.distributed.process import print0
from anyspeed.errors import OneLineArgumentParser, UsageError

PROG = "anyspeed generate"
MAX_IMAGE_PIXELS = 4096 * 4096  # stages.vlm.data.MAX_IMAGE_PIXELS: --help imports no torch
TASKS = ("greedy", "do_sample", "beam_search", "beam_search_with_sampling", "chat")


def build_parser() -> argparse.ArgumentParser:
    from anyspeed.data.templates import TEMPLATES

    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    session.add_model_arguments(p)
    g = p.add_argument_group("generation")
    g.add_argument("--task", choices=TASKS, default="greedy")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompts-file", default=None, help="one prompt per line")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--num-beams", type=int, default=4)
    g.add_argument("--length-penalty", type=float, default=1.0)
    g.add_argument("--use-kv-cache", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end an answer once its text contains TEXT (repeatable; greedy, do_sample, chat)",
    )
    g.add_argument(
        "--hf-chat-template",
        action="store_true",
        help="render prompts with the tokenizer's chat template",
    )
    g.add_argument("--prompt-type", choices=sorted(TEMPLATES), default=None)
    g.add_argument("--history-turns", type=int, default=3)
    g.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image for a vision-language model to describe (repeatable)",
    )
    g.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of a video's frame images, for a Qwen-VL model (repeatable)",
    )
    g.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_IMAGE_PIXELS,
        help="--image files with more pixels are refused before decoding (default 4096^2)",
    )
    return p


def _check(args: argparse.Namespace, model: Any, tok: Any) -> None:
    if args.image or args.video or session.is_llava(model):
        image.check(args, model)
        return
    try:
        sampling_params(args).check()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for flag in ("max_new_tokens", "num_beams", "history_turns"):
        if getattr(args, flag) < (0 if flag == "history_turns" else 1):
            raise UsageError(f"--{flag.replace('_', '-')} must be positive")
    if any(not s for s in args.stop) or (args.stop and args.task.startswith("beam_search")):
        raise UsageError("--stop needs a non-empty text, and is not for beam search")
    if args.hf_chat_template and not tok.has_chat_template:
        raise UsageError(
            f"--hf-chat-template: tokenizer {tok.name} has no chat template; pass --prompt-type"
        )
    texts = prompts(args)
    if args.task != "chat" and not texts and args.prompts_file:
        raise UsageError(f"--prompts-file {args.prompts_file!r} holds no prompt (every line empty)")
    if args.task != "chat" and not texts:
        raise UsageError(f"--task {args.task} needs --prompt or --prompts-file")
    for text, ids in zip(texts, _encoded(args, tok, texts), strict=True):
        if len(ids) >= args.max_length:
            raise UsageError(
                f"prompt {text[:40]!r} is {len(ids)} tokens, longer than the "
                f"context of {args.max_length} (--max-length)"
            )


def _encoded(args: argparse.Namespace, tok: Any, texts: list[str]) -> list[list[int]]:
    rendered = [render(args, tok, [{"role": "user", "content": t}]) for t in texts]
    return tok.encode(rendered, special=not (args.hf_chat_template or args.prompt_type))


def _body(run: session.InferenceRun, model: list) -> None:
    args, tok = run.args, run.tokenizer
    if run.llava:
        image.generate(run, model)
        return
    if args.task == "chat":
        from anyspeed.commands.chat import chat

        chat(args, model, tok)
        return
    from anyspeed.inference.beam import beam_search
    from anyspeed.inference.decode import generate

    req = request(args, tok)
    texts = prompts(args)
    ids_of = _encoded(args, tok, texts)
    if args.task.startswith("beam_search"):
        outs = [beam_search(model, ids, req, args.num_beams, args.length_penalty) for ids in ids_of]
    else:
        outs = generate(model, ids_of, req)
    for prompt, ids in zip(texts, outs, strict=True):
        print0(f"prompt: {prompt}\n{text_of(tok, ids, req.eos_ids)}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``anyspeed generate``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = runner.Command(PROG, build_parser(), _check, _body, early=image.check_files)
    return runner.run(cmd, argv)


if __name__ == "__main__":
    raise SystemExit(main())
