"""What ``anyspeed generate``, its chat and ``anyspeed evaluate`` share: a conversation rendered
as a prompt (chat template, ``--prompt-type`` template or raw text), the end tokens, the decode
request the generation flags describe, and the text of generated ids."""

from __future__ import annotations

import argparse
from typing import Any

from anyspeed.data.tokenizer import end_ids
from anyspeed.errors import UsageError

__all__ = ["end_ids", "prompts", "render", "request", "sampling_params", "text_of"]


def render(args: argparse.Namespace, tok: Any, messages: list[dict]) -> str:
    """The prompt text of a conversation ending in a user turn (template or raw text)."""
    if args.hf_chat_template:
        return tok.render_chat(messages, add_generation_prompt=True)
    if args.prompt_type:
        return template_prompt(args.prompt_type, messages)
    return messages[-1]["content"]


def template_prompt(prompt_type: str, messages: list[dict]) -> str:
    """A conversation ending in a user turn, rendered by built-in template ``prompt_type`` up
    to the open answer."""
    from anyspeed.data.templates import TEMPLATES

    segs = TEMPLATES[prompt_type].segments([*messages, {"role": "assistant", "content": ""}])
    return "".join(text for text, _, _ in segs[:-1])


def sampling_params(args: argparse.Namespace):
    """The sampling the flags describe (``--task``, ``--temperature``, ``--top-k``, ``--top-p``)."""
    from anyspeed.inference.sampling import SamplingParams

    return SamplingParams(
        greedy=args.task not in ("do_sample", "beam_search_with_sampling", "chat"),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
    )


def request(args: argparse.Namespace, tok: Any):
    """The decode request the flags describe."""
    from anyspeed.inference.decode import Request
    from anyspeed.inference.generate import decode

    return Request(
        args.max_new_tokens,
        sampling_params(args),
        eos_ids=end_ids(tok),
        pad_id=tok.pad_id or 0,
        use_kv_cache=args.use_kv_cache,
        seed=args.seed,
        max_length=args.max_length,
        vocab_size=tok.vocab_size,
        stop=tuple(args.stop),
        detokenize=lambda ids: decode(tok, ids),
    )


def text_of(tok: Any, ids: list[int], eos: tuple[int, ...]) -> str:
    """Decoded ``ids`` without a final end token."""
    from anyspeed.inference.generate import decode

    return decode(tok, ids[:-1] if ids and ids[-1] in eos else ids)


def prompts(args: argparse.Namespace) -> list[str]:
    """--prompt's texts, then --prompts-file's lines (UsageError naming the flag or file for
    text that is not UTF-8, or a file that cannot be read)."""
    for text in args.prompt:
        bad = next((c for c in text if "\udc80" <= c <= "\udcff"), None)
        if bad is not None:  # bytes the command line could not decode, kept as surrogates
            raise UsageError(
                f"--prompt {text[:40]!r}: not UTF-8 text (byte "
                f"0x{ord(bad) - 0xDC00:02x}); pass UTF-8"
            )
    texts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                texts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as exc:
            raise UsageError(f"--prompts-file {args.prompts_file!r}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            byte = f"0x{exc.object[exc.start]:02x} at offset {exc.start}"
            raise UsageError(
                f"--prompts-file {args.prompts_file!r}: not UTF-8 text (byte {byte})"
            ) from None
    return texts
