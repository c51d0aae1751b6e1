"""MindSpeed-LLM's on-the-fly preprocessing: a ``--data-path`` that names a raw dataset (a
``.json``/``.jsonl``/``.parquet``/``.arrow``/``.csv``/``.txt`` file, or a folder of them) is
tokenized into ``.bin/.idx`` at start-up, with the run's tokenizer, ``--handler-name``,
``--prompt-type``, ``--seq-length`` and ``--pack``, and the run trains on that output.

As in MindSpeed-LLM the output lies beside the input (``data/alpaca.json`` ->
``data/alpaca_packed_*``; pretraining data ``data/c4_text_document``) unless ``--output-prefix``
names it. Unlike MindSpeed-LLM, which converts again at every start, the output is kept: a
manifest beside it records the input files and the settings, the next run reuses it, and a
change to either rebuilds it. Files the manifest does not vouch for are never overwritten
without ``--overwrite-cache``. Ranks started by torchrun take a file lock, so one process per
file system converts and the others reuse its output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from anyspeed.errors import UsageError

if TYPE_CHECKING:
    from anyspeed.data.pipeline import Config, Job
    from anyspeed.data.progress import Stats

MANIFEST = ".preprocess.json"  # beside the output prefix
LOCK = ".preprocess.lock"
_VERSION = 1

# stage -> (the handler when --handler-name is absent, the handler group it trains on)
_PRETRAIN, _INSTRUCTION, _PAIRWISE, _STEPS, _PROMPTS = (
    "pretraining",
    "instruction",
    "pairwise",
    "step-labelled",
    "prompt",
)
_STAGE_DATA = {
    "pretrain": _PRETRAIN,
    "sft": _INSTRUCTION,
    "dpo": _PAIRWISE,
    "simpo": _PAIRWISE,
    "orm": _PAIRWISE,
    "prm": _STEPS,
    "grpo": _PROMPTS,
    "ppo": _PROMPTS,
    "distill": _PROMPTS,
}
# The flags that only steer the conversion: a note when the data is already preprocessed.
_CONVERT_ONLY = (
    "pack",
    "workers",
    "n_subs",
    "json_keys",
    "map_keys",
    "append_eod",
    "output_prefix",
    "overwrite_cache",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """MindSpeed-LLM's preprocessing flags in a training command line (its ``posttrain_gpt.py``
    takes them); they act when ``--data-path`` is a raw dataset."""
    g = parser.add_argument_group("on-the-fly preprocessing (a raw --data-path)")
    g.add_argument("--handler-name", default=None, help="anyspeed preprocess's handlers")
    g.add_argument("--json-keys", nargs="+", default=None, help="default: text")
    g.add_argument("--map-keys", default=None, help="JSON column renames, as preprocess")
    g.add_argument("--append-eod", action="store_true", help="pretraining documents")
    g.add_argument("--pack", action="store_true", help="pack samples to --seq-length")
    g.add_argument(
        "--enable-thinking",
        choices=("true", "false", "none", "True", "False", "None"),
        metavar="{true,false,none}",
        help="with --prompt-type qwen3: true = qwen3, false/none = qwen3-nothink",
    )
    g.add_argument("--workers", type=int, default=None, help="tokenizing processes")
    g.add_argument("--n-subs", type=int, default=None, help="file groups converted apart")
    g.add_argument("--output-prefix", default=None, help="default: the input's path")
    g.add_argument(
        "--overwrite-cache",
        action="store_true",
        help="let the conversion replace .bin/.idx files it did not write",
    )


def _groups() -> dict[str, tuple[str, ...]]:
    from anyspeed.data.registry import HANDLERS, PAIRWISE_HANDLERS, PRM_HANDLERS, RL_HANDLERS

    return {
        _PRETRAIN: ("GeneralPretrainHandler",),
        _INSTRUCTION: tuple(h for h in HANDLERS if h != "GeneralPretrainHandler"),
        _PAIRWISE: PAIRWISE_HANDLERS,
        _STEPS: PRM_HANDLERS,
        _PROMPTS: RL_HANDLERS,
    }


def is_raw(path: str) -> bool:
    """Whether a ``--data-path`` item names a raw dataset (a file or folder in a format
    ``anyspeed preprocess`` reads) rather than a ``.bin/.idx`` prefix."""
    from anyspeed.data.readers import detect_format

    if os.path.isfile(path):
        return not path.endswith((".bin", ".idx")) and detect_format(path)[0] is not None
    if os.path.isdir(path):
        return any(detect_format(e.path)[0] is not None for e in os.scandir(path) if e.is_file())
    return False


def _path_slots(items: list[str]) -> list[int]:
    """The indices of the paths in ``--data-path`` (every item, or every second of WEIGHT
    PREFIX pairs)."""
    try:
        float(items[0])
    except ValueError:
        return list(range(len(items)))
    return list(range(1, len(items), 2))


def resolve(args: argparse.Namespace, stage: str, command: str) -> None:
    """Apply ``--enable-thinking`` to ``--prompt-type`` and convert every raw ``--data-path``
    item in place (before the flags are frozen); UsageError on a bad request, before any
    output is written."""
    from anyspeed.data.templates import thinking_template

    if args.enable_thinking is not None:
        args.prompt_type = thinking_template(
            getattr(args, "prompt_type", None), args.enable_thinking.lower()
        )
    group = _STAGE_DATA.get(stage)
    if group is None:  # e.g. the VLM stages, which read their .json/.jsonl data as it is
        if args.handler_name:
            raise UsageError(
                f"--handler-name: --stage {stage} reads its --data-path as it is (no "
                "preprocessing); remove it"
            )
        return
    items = list(args.data_path or [])
    slots = [i for i in _path_slots(items) if is_raw(items[i])] if items else []
    if not slots:
        _note_unused(args, command)
        return
    handler = _handler(args, stage, group, items[slots[0]])
    for i in slots:
        out = _output_prefix(args, items[i], len(slots))
        items[i] = _convert(args, stage, handler, items[i], out, command)
    args.data_path = items


def _handler(args: argparse.Namespace, stage: str, group: str, path: str) -> str:
    """``--handler-name``, or the stage's one handler; it must write the stage's data."""
    from anyspeed.data.registry import HANDLER_NAMES

    names = _groups()[group]
    if args.handler_name is None:
        if len(names) == 1:
            return names[0]
        raise UsageError(
            f"--data-path {path!r} is a raw dataset: name its --handler-name ({', '.join(names)})"
            " to preprocess it at start-up, or give an `anyspeed preprocess` output prefix"
        )
    if args.handler_name not in names:
        what = "unknown" if args.handler_name not in HANDLER_NAMES else "not for this stage"
        raise UsageError(
            f"--handler-name {args.handler_name} ({what}): --stage {stage} trains on {group} "
            f"data; choose {', '.join(names)}"
        )
    return args.handler_name


def _output_prefix(args: argparse.Namespace, path: str, count: int) -> str:
    """MindSpeed-LLM's naming: the file without its extension, a folder's own name inside
    it; ``--output-prefix`` (suffixed by each input's name when there are several)."""
    path = os.path.normpath(path)
    base = (
        os.path.join(path, os.path.basename(path))
        if os.path.isdir(path)
        else os.path.splitext(path)[0]
    )
    if args.output_prefix:
        name = os.path.basename(base)
        base = args.output_prefix if count == 1 else f"{args.output_prefix}_{name}"
    folder = os.path.dirname(os.path.abspath(base))
    probe = folder
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK):
        raise UsageError(
            f"--data-path {path!r}: its preprocessed data cannot be written in {folder} (not "
            "writable); name a writable place with --output-prefix"
        )
    return base


def _config(args: argparse.Namespace, stage: str, handler: str, path: str, out: str) -> Config:
    from anyspeed.data.pipeline import Config
    from anyspeed.data.tokenizer import TokenizerSpec
    from anyspeed.launch import reports_here

    if not args.tokenizer_name_or_path:
        raise UsageError(
            f"--data-path {path!r} is a raw dataset: it needs --tokenizer-name-or-path"
        )
    return Config(
        input=path,
        output_prefix=out,
        tokenizer=TokenizerSpec(name_or_path=args.tokenizer_name_or_path),
        handler_name=handler,
        json_keys=args.json_keys or ["text"],
        append_eod=args.append_eod,
        map_keys=args.map_keys,
        prompt_type=getattr(args, "prompt_type", None),
        seq_length=None if stage == "pretrain" else args.seq_length,
        pack=args.pack,
        neat_pack=getattr(args, "neat_pack", False),
        workers=args.workers or 1,
        partitions=args.n_subs or 1,
        overwrite=True,  # whether it may is decided here, against the manifest
        progress=reports_here() and sys.stderr.isatty(),  # a live line; logs get the summary
        placeholder_token=getattr(args, "placeholder_token", None),
        reward_tokens=getattr(args, "reward_tokens", None),
    )


def _convert(
    args: argparse.Namespace, stage: str, handler: str, path: str, out: str, command: str
) -> str:
    """The training prefix of raw ``path`` preprocessed to ``out``: reused when its manifest
    matches, else (re)built; under a lock, so concurrent ranks convert once."""
    from anyspeed.data.errors import DataError
    from anyspeed.data.pipeline import prepare
    from anyspeed.data.runner import run_prepared
    from anyspeed.data.writer import dataset_paths
    from anyspeed.launch import reports_here

    cfg = _config(args, stage, handler, path, out)
    with _locked(out + LOCK):
        job, _ = prepare(cfg)  # every flag checked; nothing written yet
        want = _manifest(job)
        files = [p for prefix in job.prefixes.values() for p in dataset_paths(prefix)]
        have = _read_manifest(out + MANIFEST)
        ready = all(os.path.isfile(f) for f in files)
        prog = f"anyspeed {command}"
        if ready and have == want:  # its own output, current: torchrun's other ranks too
            if reports_here():
                print(
                    f"{prog}: --data-path {path!r}: reusing its preprocessed {out}", file=sys.stderr
                )
        else:
            ours = have is not None
            if any(os.path.exists(f) for f in files) and not ours and not args.overwrite_cache:
                raise UsageError(
                    f"--data-path {path!r}: {out}'s .bin/.idx files exist and this run did not "
                    "write them; give that prefix as --data-path, or --overwrite-cache to rebuild"
                )
            why = "its input or settings changed" if ours and ready else "preprocessing"
            print(f"{prog}: --data-path {path!r}: {why} -> {out}", file=sys.stderr)
            _write_json(out + MANIFEST, {"state": "building"})
            try:
                _report(prog, run_prepared(job))
            except DataError as exc:
                raise UsageError(f"--data-path {path!r}: {exc}") from None
            _write_json(out + MANIFEST, want)
    if stage != "pretrain":
        return out
    if len(job.prefixes) != 1:
        raise UsageError("--json-keys: pretraining from a raw --data-path takes one key")
    return next(iter(job.prefixes.values()))


def _report(prog: str, stats: Stats) -> None:
    """The preprocessing summary (and its skipped records) as the command's own lines."""
    from anyspeed.data.progress import summary

    for line in summary(stats).splitlines():
        line = line.strip().removeprefix("anyspeed preprocess: ")
        if not line.startswith("wrote "):
            print(f"{prog}: {line}", file=sys.stderr)


def _manifest(job: Job) -> dict:
    """What the output was built from: the input files (size, mtime), the tokenizer's files
    and every setting that changes the tokens."""
    cfg = job.cfg
    keep = (
        "handler_name",
        "json_keys",
        "append_eod",
        "map_keys",
        "prompt_type",
        "seq_length",
        "pack",
        "neat_pack",
        "pack_window",
        "input_format",
        "txt_doc_per_file",
        "placeholder_token",
        "reward_tokens",
    )
    return {
        "anyspeed_preprocess": _VERSION,
        "inputs": [_stamp(f.path) for f in job.files],
        "tokenizer": _tokenizer_stamp(cfg.tokenizer.name_or_path),
        "settings": {k: getattr(cfg, k) for k in keep},
    }


def _stamp(path: str) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def _tokenizer_stamp(path: str) -> list:
    """The tokenizer's own files (not the weights beside them in a model folder)."""
    if os.path.isfile(path):
        return [_stamp(path)]
    weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
    names = sorted(n for n in os.listdir(path) if not n.endswith(weights))
    return [_stamp(os.path.join(path, n)) for n in names if os.path.isfile(os.path.join(path, n))]


def _read_manifest(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path: str, value: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if absent) for the block; a no-op where the
    platform has no ``fcntl``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _note_unused(args: argparse.Namespace, command: str) -> None:
    """Preprocessing flags beside an already preprocessed ``--data-path``: say they did
    nothing (MindSpeed-LLM's recipes pass them either way)."""
    from anyspeed.launch import reports_here

    given = [f"--{k.replace('_', '-')}" for k in _CONVERT_ONLY if getattr(args, k, None)]
    if given and args.data_path and reports_here():
        print(
            f"anyspeed {command}: note: {'/'.join(given)} apply to a raw --data-path (it is "
            "preprocessed at start-up); the .bin/.idx data given is used as it is",
            file=sys.stderr,
        )
