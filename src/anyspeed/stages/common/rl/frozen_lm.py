"""A frozen causal language model beside the policy (the distillation teacher, a process reward
model): a checkpoint, or a Hugging Face ``*ForCausalLM`` directory converted once as ``--load``
converts one, reading the policy's tokens, of any architecture the training layout splits;
checked before start."""

from __future__ import annotations

import argparse
import os
from typing import Any

from anyspeed.errors import UsageError


def check_causal_lm(args: argparse.Namespace, path: str, flag: str) -> tuple[str, Any]:
    """(checkpoint, architecture when not the policy's) of ``flag``'s ``path``, checked: a
    whole checkpoint of a model sharing the policy's vocabulary (and, where both directories
    hold one, its tokenizer) whose heads and layers the training layout splits."""
    from anyspeed.checkpoint.reads import tracked_dir
    from anyspeed.distributed.process import planned_world_size
    from anyspeed.models.presets import model_from_args
    from anyspeed.stages.common.rl.reward_layout import architecture, check_fits_layout
    from anyspeed.stages.common.value_head import check_model_dir

    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is not a directory")
    if tracked_dir(path) is None:
        path = _from_hf(args, path, flag)
    policy = model_from_args(args)
    own = architecture(args, path, policy, flag=flag)
    if own is not None:
        world = planned_world_size(args.nproc_per_node)
        check_fits_layout(args, own, world, flag, "choose sizes that split both models")
    return check_model_dir(args, path, flag, head=False, model=own or policy), own


def _from_hf(args: argparse.Namespace, path: str, flag: str) -> str:
    """A Hugging Face causal-LM directory converted once beside the run's conversions."""
    from anyspeed.convert import hf_cache
    from anyspeed.convert.hf_io import read_config
    from anyspeed.convert.reward import is_reward_config

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(
            f"{flag} {path!r} is neither a checkpoint (no tracker file) nor a Hugging Face "
            "model directory (no config.json)"
        )
    try:
        cfg = read_config(path, raw=True)
    except UsageError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    if is_reward_config(cfg):
        raise UsageError(
            f"{flag} {path!r} is a reward model (*ForSequenceClassification); give a causal "
            "LM (*ForCausalLM)"
        )
    check_tokens(path, args.tokenizer_name_or_path, flag)
    return hf_cache.convert(args, path, f"anyspeed posttrain --stage {args.stage}", flag=flag)


def check_tokens(theirs_dir: str, ours_dir: str | None, flag: str) -> None:
    """Where both directories hold a ``tokenizer.json``, ``flag``'s must give every token the
    policy's id: the models read the same token ids (a vocabulary of the same size is not
    enough)."""
    theirs = _vocab(theirs_dir)
    ours = _vocab(ours_dir) if ours_dir else None
    if theirs is None or ours is None or theirs == ours:
        return
    moved = sum(theirs.get(t) != i for t, i in ours.items())
    raise UsageError(
        f"{flag} {theirs_dir!r}: its tokenizer differs from --tokenizer-name-or-path "
        f"{ours_dir!r} ({moved} of {len(ours)} tokens have another id or none); it must share "
        "the policy's tokenizer"
    )


def _vocab(directory: str) -> dict[str, int] | None:
    """Every token's id (added tokens included) in ``directory``'s ``tokenizer.json``; None
    where it has none or it cannot be read (nothing to compare)."""
    from pathlib import Path

    from anyspeed.convert.hf_io import read_json

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
        vocab = dict(doc["model"]["vocab"])
    except (UsageError, KeyError, TypeError, ValueError):
        return None
    vocab.update({t["content"]: t["id"] for t in doc.get("added_tokens") or [] if "content" in t})
    return vocab
