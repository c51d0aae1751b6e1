"""Command line for ``anyspeed preprocess`` and ``anyspeed train-tokenizer``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from anyspeed import quiet
from anyspeed.data.errors import DataError, UsageError
from anyspeed.data.readers import FORMATS
from anyspeed.data.registry import HANDLER_NAMES
from anyspeed.data.templates import TEMPLATES, thinking_template
from anyspeed.errors import OneLineArgumentParser, report

_TOKENIZER_ALIASES = {"GPTSentencePieceTokenizer": "SentencePieceTokenizer"}


def _preprocess_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="anyspeed preprocess", description="Tokenize a corpus into .bin/.idx."
    )
    io = p.add_argument_group("input/output")
    io.add_argument("--input", required=True, help="file, glob or directory of one format")
    io.add_argument("--input-format", choices=FORMATS, help="override the file-name guess")
    io.add_argument("--txt-doc-per-file", action="store_true", help="a .txt file is one doc")
    io.add_argument("--output-prefix", required=True)
    io.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    t = p.add_argument_group("tokenizer")
    t.add_argument("--tokenizer-type", default="PretrainedFromHF")
    t.add_argument("--tokenizer-name-or-path", help="local HF directory or tokenizer.json")
    t.add_argument("--tokenizer-model", help="SentencePiece .model file")
    t.add_argument("--vocab-file", help="GPT-2 vocab.json")
    t.add_argument("--merge-file", help="GPT-2 merges.txt")
    t.add_argument(
        "--tokenizer-not-use-fast",
        action="store_true",
        help="accepted: the tokenizer is read from its tokenizer.json (the fast form)",
    )
    h = p.add_argument_group("handler")
    names = ", ".join(HANDLER_NAMES)
    h.add_argument("--handler-name", default="GeneralPretrainHandler", help=names)
    h.add_argument("--json-keys", nargs="+", default=["text"])
    h.add_argument("--append-eod", action="store_true")
    h.add_argument("--map-keys", help='JSON, e.g. \'{"prompt":"instruction","response":"output"}\'')
    h.add_argument("--prompt-type", help=f"built-in template: {', '.join(sorted(TEMPLATES))}")
    h.add_argument(
        "--enable-thinking",
        type=str.lower,
        choices=("true", "false", "none"),
        help="MindSpeed-LLM's, with --prompt-type qwen3: true = the empty thinking block opens "
        "the response (qwen3), false or none = it closes the prompt (qwen3-nothink)",
    )
    h.add_argument("--seq-length", type=int, help="drop longer samples; pack length")
    h.add_argument("--pack", action="store_true", help="pack instruction samples to --seq-length")
    h.add_argument("--neat-pack", action="store_true", help="attention_mask holds segment ids")
    h.add_argument("--pack-window", type=int, default=10000, help="samples packed together")
    h.add_argument(
        "--placeholder-token", help="step-labelled data: the token ending each step (ки)"
    )
    h.add_argument(
        "--reward-tokens", nargs="+", help="step-labelled data: the label tokens, good first"
    )
    r = p.add_argument_group("run")
    r.add_argument("--workers", type=int, default=1)
    r.add_argument("--partitions", type=int, default=1, help="file groups merged at the end")
    r.add_argument("--strict", action="store_true", help="fail at the first bad record")
    r.add_argument("--quiet", action="store_true", help="no progress line or summary")
    r.add_argument("--chunk-docs", type=int, default=512, help="records per work unit")
    # MindSpeed-LLM's preprocess_data.py flags its data_convert scripts pass, accepted
    every = "accepted: the progress line updates about once a second (--quiet: none)"
    r.add_argument("--log-interval", type=int, default=None, help=every)
    r.add_argument(
        "--overwrite-cache", action="store_true", help="accepted: no dataset cache is kept"
    )
    return p


def _train_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="anyspeed train-tokenizer", description="Train a byte-level BPE tokenizer."
    )
    p.add_argument("--input", nargs="+", required=True, help="files, globs or directories")
    p.add_argument("--input-format", choices=FORMATS)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--overwrite", action="store_true")
    return p


def _preprocess(argv: list[str]) -> int:
    from anyspeed.data.pipeline import Config
    from anyspeed.data.runner import preprocess
    from anyspeed.data.tokenizer import TokenizerSpec

    a = _preprocess_parser().parse_args(argv)
    spec = TokenizerSpec(
        kind=_TOKENIZER_ALIASES.get(a.tokenizer_type, a.tokenizer_type),
        name_or_path=a.tokenizer_name_or_path,
        model=a.tokenizer_model,
        vocab_file=a.vocab_file,
        merge_file=a.merge_file,
    )
    if a.chunk_docs < 1 or a.pack_window < 1:
        raise UsageError("--chunk-docs and --pack-window must be at least 1")
    cfg = Config(
        input=a.input,
        output_prefix=a.output_prefix,
        tokenizer=spec,
        handler_name=a.handler_name,
        json_keys=a.json_keys,
        append_eod=a.append_eod,
        map_keys=a.map_keys,
        prompt_type=thinking_template(a.prompt_type, a.enable_thinking),
        seq_length=a.seq_length,
        pack=a.pack,
        neat_pack=a.neat_pack,
        pack_window=a.pack_window,
        workers=a.workers,
        partitions=a.partitions,
        input_format=a.input_format,
        txt_doc_per_file=a.txt_doc_per_file,
        strict=a.strict,
        overwrite=a.overwrite,
        progress=not a.quiet,
        chunk_docs=a.chunk_docs,
        placeholder_token=a.placeholder_token,
        reward_tokens=a.reward_tokens,
    )
    preprocess(cfg)
    return 0


def _train(argv: list[str]) -> int:
    from anyspeed.data.train_tokenizer import train_tokenizer

    a = _train_parser().parse_args(argv)
    out = train_tokenizer(
        a.input,
        a.output_dir,
        a.vocab_size,
        a.min_frequency,
        a.json_keys,
        a.input_format,
        a.overwrite,
    )
    print(f"anyspeed train-tokenizer: saved {out}", file=sys.stderr)
    return 0


COMMANDS = {"preprocess": _preprocess, "train-tokenizer": _train}


def main(argv: list[str]) -> int:
    """Run ``preprocess`` or ``train-tokenizer``; usage errors exit 2, bad data 1."""
    quiet.install()
    if not argv or argv[0] not in COMMANDS:
        got = argv[0] if argv else "nothing"
        return report("anyspeed", UsageError(f"expected one of {', '.join(COMMANDS)}, got {got}"))
    if argv[1:2] in (["-h"], ["--help"]):
        parser = _preprocess_parser() if argv[0] == "preprocess" else _train_parser()
        parser.print_help()
        return 0
    previous = _terminate_as_interrupt()
    try:
        return COMMANDS[argv[0]](argv[1:])
    except UsageError as exc:
        return report("anyspeed", exc)
    except DataError as exc:
        return report("anyspeed", exc, code=1)
    except KeyboardInterrupt:
        print("anyspeed: interrupted; no output was written", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _terminate_as_interrupt() -> dict:
    """Make SIGTERM and SIGHUP clean up temp files like Ctrl-C does (main thread only);
    returns the handlers to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
