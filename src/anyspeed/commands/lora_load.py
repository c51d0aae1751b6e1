"""``--lora-load`` for ``anyspeed generate`` and ``evaluate``: a LoRA checkpoint of
``anyspeed posttrain`` applied onto the ``--load`` base model, as MindSpeed-LLM's inference
scripts pass it (``--lora-load`` with ``--lora-r``/``--lora-alpha``/``--lora-target-modules``,
checked against the checkpoint's record). The adapters load at any saved layout and are folded
into the weights before decoding (``training/lora_fold.py``)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from anyspeed.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The LoRA flags of the inference commands."""
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-load", default=None, help="a LoRA checkpoint of anyspeed posttrain")
    g.add_argument("--lora-r", type=int, default=None, help="checked against --lora-load")
    g.add_argument("--lora-alpha", type=float, default=None, help="checked against it")
    g.add_argument("--lora-target-modules", nargs="+", default=None, help="checked against it")
    g.add_argument("--lora-fusion", action="store_true", help=argparse.SUPPRESS)  # MindSpeed's


def check(args: argparse.Namespace, model: Any) -> None:
    """UsageError unless ``--lora-load`` is a LoRA checkpoint of this model, trained with the
    LoRA flags given (each given one); nothing without ``--lora-load``."""
    from anyspeed.checkpoint.reads import read_common, tracked_dir
    from anyspeed.checkpoint.record import model_in_common
    from anyspeed.models.config import ModelConfig
    from anyspeed.models.lora import LoraRecord

    given = [f for f in ("lora_r", "lora_alpha", "lora_target_modules") if getattr(args, f)]
    if not args.lora_load:
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UsageError(f"{flag} describes a LoRA checkpoint: give it with --lora-load")
        return
    where = f"--lora-load {args.lora_load!r}"
    try:
        path = tracked_dir(args.lora_load)
        common = read_common(path) if path else None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{where}: {exc}") from None
    record = LoraRecord.from_common(common) if common is not None else None
    if record is None:
        raise UsageError(f"{where}: not a LoRA checkpoint of anyspeed posttrain")
    if not isinstance(model, ModelConfig):
        raise UsageError(
            f"{where}: a vision-language model's adapters are not applied here yet; merge them "
            "first (anyspeed convert --lora-load) and --load the merged directory"
        )
    saved = model_in_common(common, args.lora_load, as_hf=False)
    # the name is a label, the vocabulary's padding follows the run's TP: not the adapters'
    if saved is not None:
        saved = dataclasses.replace(saved, name=model.name, vocab_size=model.vocab_size)
    diff = saved.same_architecture(model) if saved is not None else []
    if diff:
        raise UsageError(f"{where} was trained on another model ({diff[0]} differs from --load)")
    from anyspeed.convert.dcp_io import DcpReader

    saved_weights = [
        k
        for k in DcpReader(path).tensors
        if ".lora_" not in k and not k.startswith(("optimizer.", "rng"))
    ]
    if saved_weights:  # --lora-modules-to-save: trained layers beside the adapters
        raise UsageError(
            f"{where} also holds trained layers ({saved_weights[0]}, from "
            "--lora-modules-to-save); merge it first (anyspeed convert --lora-load) and --load "
            "the merged directory"
        )
    wrong = record.mismatch(
        r=args.lora_r, alpha=args.lora_alpha, target_modules=args.lora_target_modules
    )
    if wrong:
        raise UsageError(f"{where} was trained with {wrong}; pass the same {wrong.split()[0]}")


def apply(chunks: list[torch.nn.Module], lora_dir: str) -> None:
    """Attach the recorded adapters to ``chunks``, load them from ``lora_dir`` (any saved
    layout) and fold them into the weights."""
    from anyspeed.checkpoint.errors import CheckpointMismatch
    from anyspeed.checkpoint.load import load_weights
    from anyspeed.checkpoint.reads import read_common, tracked_dir
    from anyspeed.models.lora import LoraRecord
    from anyspeed.training.lora import apply_lora
    from anyspeed.training.lora_fold import fold_adapters

    record = LoraRecord.from_common(read_common(tracked_dir(lora_dir)))
    assert record is not None  # checked at parse time
    for chunk in chunks:
        apply_lora(chunk, list(record.target_modules), record.r, record.alpha)
    try:
        load_weights(lora_dir, chunks)  # the chunks' adapters view: the adapters only
    except CheckpointMismatch as exc:
        raise UsageError(str(exc).replace("--load ", "--lora-load ", 1)) from None
    for chunk in chunks:
        fold_adapters(chunk)
