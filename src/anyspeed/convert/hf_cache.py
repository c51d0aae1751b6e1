"""``anyspeed pretrain --load <Hugging Face dir>``: continue training from HF weights.

The architecture (and, when present, the tokenizer) comes from the directory; the weights are
converted once with ``anyspeed convert`` into a Megatron ``torch_dist`` checkpoint (padded for
this run's vocabulary rule), cached, and loaded as a ``release`` checkpoint: weights only,
iteration 0. Conversion runs before any process group exists (it starts its own).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time

from anyspeed.argv import get_flag as _flag
from anyspeed.argv import merge_flags, set_flag
from anyspeed.checkpoint.files import TRACKER
from anyspeed.errors import UsageError
from anyspeed.models.config import padded_vocab_size


def hf_dir_of(argv: list[str]) -> str | None:
    """The ``--load`` directory when it is a Hugging Face model directory, else None."""
    load = _flag(argv, "--load")
    if not load:
        return None
    from anyspeed.convert import is_hf_dir

    return load if is_hf_dir(load) else None


def family_of_load(load: str | None) -> str | None:
    """The model family ``--load`` holds: an HF directory's, or the one a checkpoint records
    (None without either). Flags describe the layers, not which HF family they are: a
    Qwen3-MoE is Qwen3 with experts, and only the source says which mapping converts it."""
    from anyspeed import convert

    if not load or not os.path.isdir(load):
        return None
    try:
        if convert.is_hf_dir(load):
            from anyspeed.convert.api import hf_dir_preset

            return hf_dir_preset(load).family
        from anyspeed.checkpoint.reads import read_common, tracked_dir
        from anyspeed.checkpoint.record import model_in_common

        path = tracked_dir(load)
        model = model_in_common(read_common(path), load, as_hf=False) if path else None
    except (OSError, ValueError):  # checked elsewhere, with its own one-line error
        return None
    return model.family if model is not None else None


def hf_dropout(config: dict) -> tuple[float, float]:
    """(hidden, attention) dropout an HF ``config.json`` records, 0 where it records none (the
    transformers convention; Megatron's own defaults are 0.1)."""
    text = config.get("text_config") or config

    def rate(*keys: str) -> float:
        return float(next((text[k] for k in keys if text.get(k) is not None), 0.0))

    return rate("hidden_dropout", "resid_pdrop", "hidden_dropout_prob"), rate(
        "attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"
    )


def expand(argv: list[str], hf_dir: str) -> list[str]:
    """Architecture flags from the HF ``config.json`` (explicit flags win), its dropout (0 where
    it records none, said in one line) and its tokenizer."""
    from anyspeed.convert.api import hf_dir_preset
    from anyspeed.convert.hf_io import read_config

    try:
        preset = hf_dir_preset(hf_dir)
    except ValueError as exc:  # ConvertError (a bad file) is one too
        raise UsageError(f"--load {hf_dir!r}: {exc}") from None
    tp = int(_flag(argv, "--tensor-model-parallel-size", "1"))
    divisible = int(_flag(argv, "--make-vocab-size-divisible-by", "128"))
    flags = set_flag(
        preset.megatron_args(),
        "--padded-vocab-size",
        str(padded_vocab_size(preset.vocab_size, divisible, tp)),
    )
    has_tok = any(
        os.path.isfile(os.path.join(hf_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    )
    if has_tok and not _flag(argv, "--tokenizer-type"):
        flags += ["--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", hf_dir]
    hidden, attention = hf_dropout(read_config(hf_dir))
    flags += ["--hidden-dropout", str(hidden), "--attention-dropout", str(attention)]
    given = [f for f in ("--hidden-dropout", "--attention-dropout") if _flag(argv, f) is not None]
    if len(given) < 2:
        _say_dropout(hf_dir, hidden, attention, given)
    return merge_flags(flags, argv)


def _say_dropout(hf_dir: str, hidden: float, attention: float, given: list[str]) -> None:
    """One line on rank 0 naming the dropout taken from the HF config (not Megatron's 0.1)."""
    from anyspeed.launch import reports_here

    if reports_here():
        kept = f" ({given[0]} as given)" if given else ""
        print(
            f"anyspeed: dropout from {hf_dir}/config.json: hidden {hidden:g}, attention "
            f"{attention:g}{kept}; --hidden-dropout/--attention-dropout override it",
            flush=True,
        )


_MIB = 1 << 20


def weights_identity(hf_dir: str) -> list[str]:
    """Name, size, mtime and a hash of the first and last MiB of config.json, the index and
    every safetensors file: new weights under an unchanged config.json are a new conversion."""
    out = []
    for name in sorted(os.listdir(hf_dir)):
        if name != "config.json" and not name.endswith((".safetensors", ".safetensors.index.json")):
            continue
        path = os.path.join(hf_dir, name)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                h = hashlib.blake2b(f.read(_MIB), digest_size=16)
                f.seek(max(_MIB, st.st_size - _MIB))
                h.update(f.read(_MIB))
        except OSError as exc:
            raise UsageError(f"--load {hf_dir!r}: cannot read {name} ({exc.strerror})") from None
        out.append(f"{name}:{st.st_size}:{st.st_mtime_ns}:{h.hexdigest()}")
    return out


def converted_dir(args: argparse.Namespace, hf_dir: str) -> str:
    """Where the converted checkpoint for this run lives (under --save, else a temp dir),
    named after the weights' identity and the run's vocabulary padding and dtype."""
    padded = "" if args.padded_vocab_size is None else str(args.padded_vocab_size)
    key = "|".join([os.path.abspath(hf_dir), *weights_identity(hf_dir), padded, _dtype(args)])
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    root = args.save or os.path.join(tempfile.gettempdir(), "anyspeed-hf")
    return os.path.join(root, f"from-hf-{os.path.basename(os.path.abspath(hf_dir))}-{digest}")


def _dtype(args: argparse.Namespace) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def convert(
    args: argparse.Namespace,
    hf_dir: str,
    prog: str = "anyspeed pretrain",
    timeout: float = 3600.0,
    flag: str = "--load",
) -> str:
    """Convert for parsed ``args`` (once; local rank 0 under a launcher, others wait) and
    return the directory; ``prog`` names the command that runs in its progress line, ``flag``
    the flag that named ``hf_dir`` in errors."""
    from anyspeed.convert.hf_io import text_model_note

    out = converted_dir(args, hf_dir)
    done = os.path.join(out, TRACKER)
    if os.path.isfile(done):
        return out
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            os.makedirs(os.path.dirname(out), exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"{flag} {hf_dir!r}: cannot create {os.path.dirname(out)} for its conversion "
                f"({exc.strerror}); check --save"
            ) from None
        cmd = [
            sys.executable,
            "-m",
            "anyspeed.cli",
            "convert",
            "--load-model-type",
            "hf",
            "--save-model-type",
            "mg",
            "--load-dir",
            hf_dir,
            "--save-dir",
            out,
            "--target-tensor-parallel-size",
            str(args.tensor_model_parallel_size),
            "--make-vocab-size-divisible-by",
            str(args.make_vocab_size_divisible_by),
            "--params-dtype",
            _dtype(args),
        ]
        print(f"{prog}: converting {hf_dir} -> {out}", flush=True)
        note = text_model_note(hf_dir)
        if note:
            print(f"{prog}: {note}", flush=True)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            msg = (res.stderr.strip().splitlines() or ["conversion failed"])[-1]
            raise UsageError(f"{flag} {hf_dir!r}: {msg}")
        return out
    deadline = time.monotonic() + timeout
    while not os.path.isfile(done):
        if time.monotonic() > deadline:
            raise UsageError(f"{flag} {hf_dir!r}: timed out waiting for local rank 0's conversion")
        time.sleep(1.0)
    return out
